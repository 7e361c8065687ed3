"""The official `openai` client against `k3-run --serve` (runner/tests/serve_openai.rs).

Usage: python openai_client.py BASE_URL API_KEY
Prints one JSON object: the plain, streamed, tool-round and raw-completion results as the
client parsed them (greedy requests, so the Rust side can compare them with raw HTTP).
"""
import json
import sys

import openai

base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "hello"}]
out = {}

r = client.chat.completions.create(model="kimi-k3", messages=msgs, max_tokens=8)
m = r.choices[0].message
out["plain"] = {
    "content": m.content,
    "reasoning": getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content"),
    "finish": r.choices[0].finish_reason,
    "completion_tokens": r.usage.completion_tokens,
}

content, reasoning, finish = "", "", None
for ch in client.chat.completions.create(model="kimi-k3", messages=msgs, max_tokens=8, stream=True):
    if not ch.choices:
        continue
    d = ch.choices[0].delta
    content += d.content or ""
    reasoning += (d.model_extra or {}).get("reasoning_content") or ""
    finish = ch.choices[0].finish_reason or finish
out["stream"] = {"content": content, "reasoning": reasoning, "finish": finish}

tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
round_msgs = msgs + [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]
r = client.chat.completions.create(model="kimi-k3", messages=round_msgs, tools=tools,
                                   tool_choice="auto", max_tokens=8)
m = r.choices[0].message
out["tools"] = {
    "content": m.content,
    "tool_calls": [tc.model_dump() for tc in (m.tool_calls or [])],
    "finish": r.choices[0].finish_reason,
    "prompt_tokens": r.usage.prompt_tokens,
}

c = client.completions.create(model="kimi-k3", prompt="once upon", max_tokens=6)
out["completion"] = {"text": c.choices[0].text, "finish": c.choices[0].finish_reason}

try:
    openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    out["wrong_key"] = "accepted"
except openai.AuthenticationError as e:
    out["wrong_key"] = e.status_code

print(json.dumps(out))

//! The messages pipeline ranks exchange, as bytes (little-endian), whatever carries them.
//!
//! Owns: encoding and decoding [`Msg`]; a message that does not decode is an error naming
//! what was wrong, never a guess. Must not: send anything (the [`super::Link`] does).

use crate::exec::TokenCarry;

/// One message between ranks.
#[derive(Clone, Debug, PartialEq)]
pub enum Msg {
    /// Rank r to r + 1: tokens of one sequence after rank r's layers. `pos` is the sequence's
    /// position before them; `want_logits`: the last rank returns the full logits (the end of
    /// a prompt); `emit`: the last rank returns the next id (a prompt's last chunk or a decode
    /// token), else only an acknowledgement.
    Work {
        seq: u32,
        pos: u32,
        emit: bool,
        want_logits: bool,
        carries: Vec<TokenCarry>,
    },
    /// The last rank to rank 0: the greedy id after a sequence's tokens (when `emit`), the
    /// FNV-1a hash of those logits' bits, and the logits when asked for.
    Result {
        seq: u32,
        emit: bool,
        id: u32,
        logits_hash: u64,
        logits: Vec<f32>,
    },
    /// Rank 0 to every rank at start: its view of the split, to be checked.
    Hello {
        n_layers: u32,
        ranges: Vec<(u32, u32)>,
    },
    /// A rank to rank 0 after loading its layers: `None` ready, `Some(why)` not.
    Status { error: Option<String> },
    /// Rank 0 to every rank after the statuses: start (`true`) or end without running.
    Go(bool),
    /// Rank 0 through the pipeline at the end: finish, report, exit.
    Stop,
    /// A rank to rank 0: its run report (JSON text) after [`Msg::Stop`].
    Report(String),
    /// A rank that failed mid-run to rank 0.
    Error(String),
    /// Rank 0 to rank 1 and back: `bytes` of payload, to measure a hop.
    Ping(Vec<u8>),
}

const WORK: u8 = 1;
const RESULT: u8 = 2;
const HELLO: u8 = 3;
const STATUS: u8 = 4;
const GO: u8 = 5;
const STOP: u8 = 6;
const REPORT: u8 = 7;
const ERROR: u8 = 8;
const PING: u8 = 9;

/// A message that does not decode.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed pipeline message: {0}")]
pub struct WireError(pub String);

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32s(&mut self, v: &[f32]) {
        self.u32(v.len() as u32);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.0.len() < n {
            return Err(WireError(format!(
                "{} bytes left, {n} expected",
                self.0.len()
            )));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn f32s(&mut self) -> Result<Vec<f32>, WireError> {
        let n = self.u32()? as usize;
        let b = self.take(n.checked_mul(4).ok_or_else(|| WireError("length".into()))?)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    fn bytes(&mut self) -> Result<Vec<u8>, WireError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String, WireError> {
        String::from_utf8(self.bytes()?).map_err(|_| WireError("text is not UTF-8".into()))
    }
    fn flag(&mut self) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError(format!("flag byte {v}"))),
        }
    }
}

/// At least the bytes of a [`Msg::Work`] with `tokens` carries of `floats_per_token` floats each (partial
/// sum and block sums), for sizing send buffers.
pub fn work_bytes(tokens: usize, floats_per_token: usize, blocks_per_token: usize) -> usize {
    24 + tokens * (4 * floats_per_token + 4 * (blocks_per_token + 1) + 8)
}

impl Msg {
    /// The message as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::new());
        match self {
            Msg::Work {
                seq,
                pos,
                emit,
                want_logits,
                carries,
            } => {
                w.u8(WORK);
                w.u32(*seq);
                w.u32(*pos);
                w.u8(*emit as u8);
                w.u8(*want_logits as u8);
                w.u32(carries.len() as u32);
                for c in carries {
                    w.u8(c.has_partial as u8);
                    w.f32s(&c.partial);
                    w.u32(c.blocks.len() as u32);
                    for b in &c.blocks {
                        w.f32s(b);
                    }
                }
            }
            Msg::Result {
                seq,
                emit,
                id,
                logits_hash,
                logits,
            } => {
                w.u8(RESULT);
                w.u32(*seq);
                w.u8(*emit as u8);
                w.u32(*id);
                w.u64(*logits_hash);
                w.f32s(logits);
            }
            Msg::Hello { n_layers, ranges } => {
                w.u8(HELLO);
                w.u32(*n_layers);
                w.u32(ranges.len() as u32);
                for (a, b) in ranges {
                    w.u32(*a);
                    w.u32(*b);
                }
            }
            Msg::Status { error } => {
                w.u8(STATUS);
                match error {
                    None => w.u8(0),
                    Some(e) => {
                        w.u8(1);
                        w.bytes(e.as_bytes());
                    }
                }
            }
            Msg::Go(go) => {
                w.u8(GO);
                w.u8(*go as u8);
            }
            Msg::Stop => w.u8(STOP),
            Msg::Report(s) => {
                w.u8(REPORT);
                w.bytes(s.as_bytes());
            }
            Msg::Error(s) => {
                w.u8(ERROR);
                w.bytes(s.as_bytes());
            }
            Msg::Ping(b) => {
                w.u8(PING);
                w.bytes(b);
            }
        }
        w.0
    }

    /// The message in `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Msg, WireError> {
        let mut r = R(bytes);
        let m = match r.u8()? {
            WORK => {
                let seq = r.u32()?;
                let pos = r.u32()?;
                let emit = r.flag()?;
                let want_logits = r.flag()?;
                let n = r.u32()? as usize;
                let mut carries = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    let has_partial = r.flag()?;
                    let partial = r.f32s()?;
                    let nb = r.u32()? as usize;
                    let mut blocks = Vec::with_capacity(nb.min(1 << 12));
                    for _ in 0..nb {
                        blocks.push(r.f32s()?);
                    }
                    carries.push(TokenCarry {
                        partial,
                        has_partial,
                        blocks,
                    });
                }
                Msg::Work {
                    seq,
                    pos,
                    emit,
                    want_logits,
                    carries,
                }
            }
            RESULT => Msg::Result {
                seq: r.u32()?,
                emit: r.flag()?,
                id: r.u32()?,
                logits_hash: r.u64()?,
                logits: r.f32s()?,
            },
            HELLO => {
                let n_layers = r.u32()?;
                let n = r.u32()? as usize;
                let mut ranges = Vec::with_capacity(n.min(1 << 12));
                for _ in 0..n {
                    ranges.push((r.u32()?, r.u32()?));
                }
                Msg::Hello { n_layers, ranges }
            }
            STATUS => Msg::Status {
                error: if r.flag()? { Some(r.string()?) } else { None },
            },
            GO => Msg::Go(r.flag()?),
            STOP => Msg::Stop,
            REPORT => Msg::Report(r.string()?),
            ERROR => Msg::Error(r.string()?),
            PING => Msg::Ping(r.bytes()?),
            k => return Err(WireError(format!("unknown kind {k}"))),
        };
        if !r.0.is_empty() {
            return Err(WireError(format!("{} trailing bytes", r.0.len())));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips_bit_for_bit() {
        let carry = |x: f32| TokenCarry {
            partial: vec![x, -0.0, f32::MIN_POSITIVE / 3.0, f32::NAN],
            has_partial: x > 0.0,
            blocks: vec![vec![1.5, 2.5, x, 0.1], vec![x; 4]],
        };
        let msgs = vec![
            Msg::Work {
                seq: 3,
                pos: 17,
                emit: true,
                want_logits: false,
                carries: vec![carry(1.0), carry(-2.0)],
            },
            Msg::Result {
                seq: 1,
                emit: false,
                id: 99,
                logits_hash: 0xdead_beef_0123_4567,
                logits: vec![0.25, -1e30],
            },
            Msg::Hello {
                n_layers: 13,
                ranges: vec![(0, 5), (5, 13)],
            },
            Msg::Status { error: None },
            Msg::Status {
                error: Some("no shard".into()),
            },
            Msg::Go(true),
            Msg::Go(false),
            Msg::Stop,
            Msg::Report("{\"rank\":1}".into()),
            Msg::Error("expert 3 failed".into()),
            Msg::Ping(vec![7; 40]),
        ];
        for m in msgs {
            let b = m.encode();
            let back = Msg::decode(&b).unwrap();
            // compare bytes, not PartialEq: NaN payloads must survive too
            assert_eq!(back.encode(), b, "{m:?}");
        }
        let work = Msg::Work {
            seq: 0,
            pos: 0,
            emit: false,
            want_logits: false,
            carries: vec![carry(1.0)],
        };
        assert!(work.encode().len() <= work_bytes(1, 4 + 8, 2));
        assert!(Msg::decode(&[]).is_err());
        assert!(Msg::decode(&[42]).is_err());
        let mut b = Msg::Stop.encode();
        b.push(0);
        assert!(Msg::decode(&b).is_err(), "trailing bytes are refused");
        let b = work.encode();
        assert!(
            Msg::decode(&b[..b.len() - 1]).is_err(),
            "a cut message is refused"
        );
    }
}

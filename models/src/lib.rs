//! k3-models: model descriptions.

//! llama-swap's HTTP API over berth (`berth serve --llama-swap`): its
//! routes (`/running`, `/unload`, `/upstream/{model}/…`, `/logs`, …) and
//! the request rewriting its config asks for (`api.rs`), and the layer its
//! config becomes: profiles, selectors, filters, listing (`layer.rs`). The
//! file itself is read by the daemon (`daemon/llama_swap/`).

pub mod api;
pub mod layer;
mod logs;
mod requests;

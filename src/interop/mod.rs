//! Tensors of other frameworks as init values, push values and pull outs.

#[cfg(feature = "candle")]
pub mod candle;

pub(crate) mod cuda;

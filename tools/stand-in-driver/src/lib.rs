#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
// The exported functions keep the C names of the APIs they stand in for.
#![allow(non_snake_case)]
// Every exported `unsafe extern "C" fn` has the contract of the NVIDIA function of the same
// name (valid pointers for its out-parameters and buffers); each unsafe block inside says which
// part it relies on.
#![allow(clippy::missing_safety_doc)]

/// The PTX interpreter of kvstore's tests (`tests/ptx_emulator`), shared by path: its three
/// files, without its unit tests (which need kvstore itself).
#[allow(dead_code)]
#[path = "../../../tests/ptx_emulator"]
pub mod emu {
    mod exec;
    mod memory;
    mod parse;

    pub use exec::{launch, Arg};
    pub use memory::{Memory, Touch};
    pub use parse::{Module, Ty};
}

mod calls;
pub mod driver;
pub mod nccl;
mod regs;
mod state;
pub mod xproc;

pub use state::Config;

//! A PTX interpreter for tests: it runs the hand-written kernels in `kernels/*.ptx` without a
//! GPU, so CI sees them execute.
//!
//! # What it covers
//!
//! Exactly the PTX those files use, parsed from the real text ([`Module::parse`]):
//! `.version`, `.target`, `.address_size 64`, `.visible .entry` with scalar `.param`s (laid out
//! in order, each aligned to its size), `.reg` (`.pred`, `.b16`/`.b32`/`.b64`, `.u32`/`.u64`,
//! `.f32`, and `%name<N>` ranges), labels, `@%p` / `@!%p` guards, and the instructions
//! `add`/`sub`/`mul`/`div` `.rn.f32`, `sqrt.rn.f32`, `neg.f32`, `add`/`sub`/`min` `.u32`/`.u64`,
//! `shl`/`and`/`or` `.b32`/`.b64`, `shr` `.u32`/`.u64`, `mul.wide.u32`, `mov` (also from
//! `%tid`, `%ntid`, `%ctaid`, `%nctaid`), `cvt.u64.u32`, `cvt.f32.f16`, `cvt.f32.bf16`,
//! `cvt.rn.f16.f32`, `cvt.rn.bf16.f32`, `cvta.to.global.u64`, `setp` (eq/ne/lt/le/gt/ge on
//! u32/u64/f32), `selp`, `ld.param`, `ld.global`/`st.global` (scalar, `.v2`, `.v4`), `bra`
//! and `ret`. Anything else (another instruction, `.ftz`, `.sat`, an `add.f32` without `.rn`
//! that ptxas could fuse into an FMA, `.shared`/`.local` memory, `bar.sync`, atomics, an operand
//! form not listed) is a parse error that names the line, so a kernel edit the interpreter does
//! not understand fails loudly. Operand register widths are checked against the instruction.
//!
//! Architectures: `.version` and `.target` must come before the first entry, the target must
//! be one its PTX ISA version knows (sm_80 needs 7.0, sm_90 7.8), and an instruction above the
//! module's `.target` or `.version` is an error naming its line, as ptxas makes it: the bf16
//! conversions (`cvt.rn.bf16.f32`, PTX ISA 7.0, and `cvt.f32.bf16`, 7.1) need sm_80. Everything
//! else in the subset runs on sm_70. [`Module::needs`] says what the most demanding instruction
//! needs, so a driver can also refuse the module on a device below it.
//!
//! [`launch`] runs every thread of the grid, one after another, each to its `ret`, and says
//! how many blocks did no work (none of their threads stored to global memory). That is a
//! faithful model only for threads that do not talk to each other, so besides having no shared
//! memory or barriers, every launch is checked for races: a thread that loads or stores global
//! memory another thread stored in the same launch, or stores what another thread loaded, is an
//! error. With no such race, every schedule a GPU could pick gives the same memory contents.
//!
//! Global memory ([`Memory`]) is separate allocations at distinct, 256-byte-aligned addresses
//! with unallocated gaps between them. Every kernel load and store is checked, as
//! compute-sanitizer would: an access not wholly inside one allocation, or not aligned to its
//! size (16 bytes for `.v4.f32`, 8 for `.v4.b16` and `.u64`, 4 for `.f32`/`.u32`, 2 for `.b16`),
//! is an error naming the instruction, its line, the thread and the address. Reading a register
//! before anything was written to it is an error too, and so is a thread that runs more than
//! 10^8 instructions.
//!
//! # Exactness
//!
//! f32 `add`/`sub`/`mul`/`div`/`sqrt` with `.rn` are IEEE 754 operations rounded to nearest
//! even on the GPU (no `.ftz` is accepted, so subnormals are kept) and are exactly Rust's f32
//! operators and `f32::sqrt`. f16/bf16 conversions use the `half` crate, which rounds to
//! nearest even like `cvt.rn`, and widens exactly. Comparisons, `selp`, integer and bit
//! operations are exact. Not bit-exact to hardware: the bits of NaN results (the GPU returns a
//! canonical NaN, the CPU a propagated or default one; a NaN is still a NaN); and `cvta.to.global`
//! is the identity, which holds for `cuMemAlloc` memory but is not checked.
//!
//! # What it does not cover
//!
//! It proves the kernels' arithmetic, indexing, bounds and alignment on the inputs it is given.
//! It says nothing about timing or performance, memory ordering and caches, warp scheduling, what
//! ptxas or the driver's JIT make of the text (build.rs assembles every file with ptxas), launch
//! limits, or the driver and the CUDA runtime.

// Shared by path with tools/stand-in-driver, whose library re-exports these items: they are
// `pub` for it, though the test crates here reach them only within the crate.
#![allow(unreachable_pub)]

mod exec;
mod memory;
mod parse;
#[cfg(test)]
mod tests;

pub use exec::{launch, Arg};
pub use memory::Memory;
pub use parse::Module;

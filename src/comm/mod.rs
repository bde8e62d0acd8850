//! Moving sums and copies between places. For now only the across-process part: MPI for CPU
//! ranks, behind the `mpi` cargo feature.

#[cfg(feature = "mpi")]
pub mod mpi;

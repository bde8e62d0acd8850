//! Runs a decoded entry: every thread of the grid, one after another, each to its `ret`.

use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};

use super::memory::Memory;
use super::parse::{mask, Cmp, Cvt, Entry, FloatOp, Instr, IntOp, Op, Reg, Special, Src, Ty};

/// A kernel argument, in the order of the entry's `.param` list.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    U64(u64),
    U32(u32),
    F32(f32),
}

/// More instructions than this in one thread is taken for an endless loop.
const STEP_LIMIT: u64 = 100_000_000;

/// Launches `entry` on `grid` blocks of `block` threads with `args`: runs every thread, in
/// order, to its end. Fails on the first error (bad access, race, uninitialized register...),
/// naming the instruction, its line and the thread.
pub fn launch(
    entry: &Entry,
    mem: &mut Memory,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: &[Arg],
) -> Result<Blocks> {
    let params = param_block(entry, args)?;
    let dims = |d: (u32, u32, u32)| [d.0, d.1, d.2];
    let (grid, block) = (dims(grid), dims(block));
    ensure!(
        grid.iter().chain(&block).all(|&d| d >= 1),
        "{}: empty launch {grid:?} x {block:?}",
        entry.name
    );
    let per_block = block.iter().product::<u32>();
    mem.begin_launch();
    let mut t = Thread {
        entry,
        params: &params,
        vals: vec![0; entry.regs.len()],
        set: vec![false; entry.regs.len()],
        ntid: block,
        nctaid: grid,
        tid: [0; 3],
        ctaid: [0; 3],
        linear: 0,
    };
    let mut block_linear = 0u32;
    let mut idle = 0u64;
    for bz in 0..grid[2] {
        for by in 0..grid[1] {
            for bx in 0..grid[0] {
                let before = mem.stores();
                let mut tid_linear = 0u32;
                for tz in 0..block[2] {
                    for ty in 0..block[1] {
                        for tx in 0..block[0] {
                            t.ctaid = [bx, by, bz];
                            t.tid = [tx, ty, tz];
                            t.linear = block_linear * per_block + tid_linear;
                            t.run(mem)?;
                            tid_linear += 1;
                        }
                    }
                }
                if mem.stores() == before {
                    idle += 1;
                }
                block_linear += 1;
            }
        }
    }
    Ok(Blocks {
        launched: grid.iter().map(|&d| u64::from(d)).product(),
        idle,
    })
}

/// How many blocks a launch ran, and how many of them did no work: none of their threads
/// stored to global memory (they returned at a bounds check, perhaps after reading a table to
/// find their work). A grid much larger than its data shows as many idle blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Blocks {
    /// Blocks in the grid.
    pub launched: u64,
    /// Blocks none of whose threads stored to global memory.
    pub idle: u64,
}

/// The `.param` block: each argument at its parameter's offset; types must match.
fn param_block(entry: &Entry, args: &[Arg]) -> Result<Vec<u8>> {
    ensure!(
        args.len() == entry.params.len(),
        "{} takes {} parameters, got {} arguments",
        entry.name,
        entry.params.len(),
        args.len()
    );
    let size = entry
        .params
        .last()
        .map_or(0, |p| (p.offset + p.ty.bytes()) as usize);
    let mut block = vec![0u8; size];
    for (p, a) in entry.params.iter().zip(args) {
        let bytes = match (p.ty, *a) {
            (Ty::U64, Arg::U64(v)) => v.to_le_bytes().to_vec(),
            (Ty::U32, Arg::U32(v)) => v.to_le_bytes().to_vec(),
            (Ty::F32, Arg::F32(v)) => v.to_le_bytes().to_vec(),
            _ => bail!(
                "{}: parameter {} is {:?}, the argument is {a:?}",
                entry.name,
                p.name,
                p.ty
            ),
        };
        let at = p.offset as usize;
        block[at..at + bytes.len()].copy_from_slice(&bytes);
    }
    Ok(block)
}

/// One thread's state. Registers hold raw bits, zero-extended to 64.
struct Thread<'a> {
    entry: &'a Entry,
    params: &'a [u8],
    vals: Vec<u64>,
    /// Whether each register has been written: reading one that has not is an error.
    set: Vec<bool>,
    ntid: [u32; 3],
    nctaid: [u32; 3],
    tid: [u32; 3],
    ctaid: [u32; 3],
    /// Block index (x fastest) times threads per block, plus thread index (x fastest).
    linear: u32,
}

impl Thread<'_> {
    /// Runs this thread from the first instruction to `ret` (or the end of the code).
    fn run(&mut self, mem: &mut Memory) -> Result<()> {
        self.set.fill(false);
        let entry = self.entry;
        let code = &entry.code;
        let mut pc = 0;
        let mut steps = 0u64;
        while let Some(ins) = code.get(pc) {
            steps += 1;
            pc += 1;
            let next = self.step(ins, mem, steps).with_context(|| {
                format!(
                    "{} line {}: `{}`, block {:?}, thread {:?} (linear id {})",
                    entry.name, ins.line, ins.text, self.ctaid, self.tid, self.linear
                )
            })?;
            match next {
                Flow::Next => {}
                Flow::Jump(to) => pc = to,
                Flow::Exit => return Ok(()),
            }
        }
        Ok(())
    }

    fn step(&mut self, ins: &Instr, mem: &mut Memory, steps: u64) -> Result<Flow> {
        ensure!(
            steps <= STEP_LIMIT,
            "more than {STEP_LIMIT} instructions in one thread: an endless loop?"
        );
        if let Some((p, negated)) = ins.guard {
            if (self.get(Src::Reg(p))? != 0) == negated {
                return Ok(Flow::Next);
            }
        }
        match &ins.op {
            &Op::Float(op, d, a, b) => {
                let (x, y) = (self.f32(a)?, self.f32(b)?);
                let r = match op {
                    FloatOp::Add => x + y,
                    FloatOp::Sub => x - y,
                    FloatOp::Mul => x * y,
                    FloatOp::Div => x / y,
                };
                self.put_f32(d, r);
            }
            &Op::Sqrt(d, a) => {
                let x = self.f32(a)?;
                self.put_f32(d, x.sqrt());
            }
            &Op::Neg(d, a) => {
                let x = self.f32(a)?;
                self.put_f32(d, -x);
            }
            &Op::Int(op, bits, d, a, b) => {
                let (x, y) = (self.get(a)?, self.get(b)?);
                let r = match op {
                    IntOp::Add => x.wrapping_add(y),
                    IntOp::Sub => x.wrapping_sub(y),
                    IntOp::Min => x.min(y),
                    // Shift amounts of the width or more give 0.
                    IntOp::Shl if y >= u64::from(bits) => 0,
                    IntOp::Shl => x << y,
                    IntOp::Shr if y >= u64::from(bits) => 0,
                    IntOp::Shr => x >> y,
                    IntOp::And => x & y,
                    IntOp::Or => x | y,
                };
                self.put(d, r & mask(bits));
            }
            &Op::MulWide(d, a, b) => {
                let (x, y) = (self.get(a)?, self.get(b)?);
                self.put(d, x * y); // both are below 2^32
            }
            &Op::Mov(d, a) => {
                let x = self.get(a)?;
                self.put(d, x);
            }
            &Op::MovSpecial(d, s) => {
                let v = match s {
                    Special::Tid(i) => self.tid[i],
                    Special::Ntid(i) => self.ntid[i],
                    Special::Ctaid(i) => self.ctaid[i],
                    Special::Nctaid(i) => self.nctaid[i],
                };
                self.put(d, u64::from(v));
            }
            &Op::Cvt(cvt, d, a) => {
                let x = self.get(a)?;
                let r = match cvt {
                    Cvt::U64FromU32 => x,
                    Cvt::F32FromF16 => u64::from(f16::from_bits(x as u16).to_f32().to_bits()),
                    Cvt::F32FromBf16 => u64::from(bf16::from_bits(x as u16).to_f32().to_bits()),
                    Cvt::F16FromF32 => u64::from(f16::from_f32(f32::from_bits(x as u32)).to_bits()),
                    Cvt::Bf16FromF32 => {
                        u64::from(bf16::from_f32(f32::from_bits(x as u32)).to_bits())
                    }
                };
                self.put(d, r);
            }
            &Op::Setp(cmp, ty, d, a, b) => {
                let (x, y) = (self.get(a)?, self.get(b)?);
                let r = if ty == Ty::F32 {
                    let (x, y) = (f32::from_bits(x as u32), f32::from_bits(y as u32));
                    // Ordered: every comparison, `ne` included, is false on NaN.
                    match cmp {
                        Cmp::Eq => x == y,
                        Cmp::Ne => x.partial_cmp(&y).is_some_and(|o| o.is_ne()),
                        Cmp::Lt => x < y,
                        Cmp::Le => x <= y,
                        Cmp::Gt => x > y,
                        Cmp::Ge => x >= y,
                    }
                } else {
                    match cmp {
                        Cmp::Eq => x == y,
                        Cmp::Ne => x != y,
                        Cmp::Lt => x < y,
                        Cmp::Le => x <= y,
                        Cmp::Gt => x > y,
                        Cmp::Ge => x >= y,
                    }
                };
                self.put(d, u64::from(r));
            }
            &Op::Selp(d, a, b, c) => {
                let r = if self.get(Src::Reg(c))? != 0 {
                    self.get(a)?
                } else {
                    self.get(b)?
                };
                self.put(d, r);
            }
            &Op::LdParam(d, ty, offset) => {
                let at = offset as usize;
                let v = le(&self.params[at..at + ty.bytes() as usize]);
                self.put(d, v);
            }
            Op::LdGlobal(ty, dsts, base, off) => {
                let addr = self.get(Src::Reg(*base))?.wrapping_add(*off as u64);
                let size = ty.bytes() as usize;
                let mut buf = [0u8; 32];
                let buf = &mut buf[..size * dsts.len()];
                mem.load(addr, buf, self.linear)?;
                for (d, bytes) in dsts.iter().zip(buf.chunks(size)) {
                    self.put(*d, le(bytes));
                }
            }
            Op::StGlobal(ty, srcs, base, off) => {
                let addr = self.get(Src::Reg(*base))?.wrapping_add(*off as u64);
                let size = ty.bytes() as usize;
                let mut buf = [0u8; 32];
                for (s, bytes) in srcs.iter().zip(buf.chunks_mut(size)) {
                    let v = self.get(*s)?;
                    bytes.copy_from_slice(&v.to_le_bytes()[..size]);
                }
                mem.store(addr, &buf[..size * srcs.len()], self.linear)?;
            }
            &Op::Bra(to) => return Ok(Flow::Jump(to)),
            Op::Ret => return Ok(Flow::Exit),
        }
        Ok(Flow::Next)
    }

    /// A source's bits; a register must have been written.
    fn get(&self, s: Src) -> Result<u64> {
        match s {
            Src::Imm(v) => Ok(v),
            Src::Reg(r) => {
                let r = usize::from(r);
                ensure!(
                    self.set[r],
                    "reads {} before anything is written to it",
                    self.entry.regs[r].0
                );
                Ok(self.vals[r])
            }
        }
    }

    fn f32(&self, s: Src) -> Result<f32> {
        Ok(f32::from_bits(self.get(s)? as u32))
    }

    fn put(&mut self, r: Reg, v: u64) {
        self.vals[usize::from(r)] = v;
        self.set[usize::from(r)] = true;
    }

    fn put_f32(&mut self, r: Reg, v: f32) {
        self.put(r, u64::from(v.to_bits()));
    }
}

/// What follows an instruction.
enum Flow {
    Next,
    Jump(usize),
    Exit,
}

/// A little-endian value of 1 to 8 bytes.
fn le(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(b)
}

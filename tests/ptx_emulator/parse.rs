//! PTX text to decoded instructions, for the subset the emulator runs (see the module doc).
//!
//! Every statement is decoded into an [`Op`] with its operand registers resolved and their
//! widths checked; anything else is an error that names the line.

use std::collections::HashMap;

use anyhow::{anyhow, bail, ensure, Context, Result};

/// A register: an index into a thread's register file.
pub type Reg = u16;

/// A source operand: a register, or an immediate already in the register's bit pattern.
#[derive(Clone, Copy, Debug)]
pub enum Src {
    Reg(Reg),
    Imm(u64),
}

/// f32 arithmetic, each rounded to nearest even (`.rn`).
#[derive(Clone, Copy, Debug)]
pub enum FloatOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Unsigned integer and bit operations on 32 or 64 bits.
#[derive(Clone, Copy, Debug)]
pub enum IntOp {
    Add,
    Sub,
    Min,
    Shl,
    Shr,
    And,
    Or,
}

/// `setp` comparisons; on f32 all are ordered (false when either side is NaN).
#[derive(Clone, Copy, Debug)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// The conversions `cvt` supports.
#[derive(Clone, Copy, Debug)]
pub enum Cvt {
    /// `cvt.u64.u32`: zero extension.
    U64FromU32,
    /// `cvt.f32.f16`: exact.
    F32FromF16,
    /// `cvt.f32.bf16`: exact.
    F32FromBf16,
    /// `cvt.rn.f16.f32`: round to nearest even.
    F16FromF32,
    /// `cvt.rn.bf16.f32`: round to nearest even.
    Bf16FromF32,
}

/// The type of a move, compare, select, load or store: its width and, for f32, how it compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    B16,
    U32,
    U64,
    F32,
}

impl Ty {
    /// Width in bits.
    pub fn bits(self) -> u32 {
        match self {
            Ty::B16 => 16,
            Ty::U32 | Ty::F32 => 32,
            Ty::U64 => 64,
        }
    }

    /// Width in bytes.
    pub fn bytes(self) -> u64 {
        u64::from(self.bits() / 8)
    }

    /// The type of a `.b16`-style suffix; signed and other float types are not supported.
    fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "b16" | "u16" => Ty::B16,
            "b32" | "u32" => Ty::U32,
            "b64" | "u64" => Ty::U64,
            "f32" => Ty::F32,
            _ => return None,
        })
    }
}

/// A special register: `%tid`, `%ntid`, `%ctaid` or `%nctaid`, with its dimension (x = 0).
#[derive(Clone, Copy, Debug)]
pub enum Special {
    Tid(usize),
    Ntid(usize),
    Ctaid(usize),
    Nctaid(usize),
}

/// One decoded instruction (without its guard).
#[derive(Clone, Debug)]
pub enum Op {
    Float(FloatOp, Reg, Src, Src),
    Sqrt(Reg, Src),
    Neg(Reg, Src),
    /// Operation, width in bits (32 or 64), destination, sources.
    Int(IntOp, u32, Reg, Src, Src),
    /// `mul.wide.u32`: the full 64-bit product of two u32.
    MulWide(Reg, Src, Src),
    Mov(Reg, Src),
    MovSpecial(Reg, Special),
    Cvt(Cvt, Reg, Src),
    /// Comparison, operand type, destination predicate, sources.
    Setp(Cmp, Ty, Reg, Src, Src),
    /// `d = c ? a : b`.
    Selp(Reg, Src, Src, Reg),
    /// Destination, type, byte offset in the parameter block.
    LdParam(Reg, Ty, u64),
    /// Element type, destinations (1, 2 or 4), address register, byte offset.
    LdGlobal(Ty, Vec<Reg>, Reg, i64),
    /// Element type, sources (1, 2 or 4), address register, byte offset.
    StGlobal(Ty, Vec<Src>, Reg, i64),
    /// Branch to the instruction with this index.
    Bra(usize),
    Ret,
}

/// A guard predicate: `@%p` is `Some((p, false))`, `@!%p` is `Some((p, true))`.
pub type Guard = Option<(Reg, bool)>;

/// An instruction, its guard and its source.
#[derive(Clone, Debug)]
pub struct Instr {
    pub guard: Guard,
    pub op: Op,
    /// 1-based line in the PTX text.
    pub line: usize,
    /// The statement as written, for error messages.
    pub text: String,
}

/// A kernel parameter and where it lies in the parameter block.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub ty: Ty,
    pub offset: u64,
}

/// One `.entry`: its parameters, registers and code.
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: String,
    pub params: Vec<Param>,
    /// Name and width of every register; width 1 is a predicate.
    pub regs: Vec<(String, u32)>,
    pub code: Vec<Instr>,
    /// The instruction of the entry that needs the highest architecture, if any needs more
    /// than sm_70.
    pub needs: Option<Needs>,
}

/// A parsed PTX module: its `.version`, its `.target`, and its entries, in order.
#[derive(Clone, Debug)]
pub struct Module {
    /// `.version` as major * 10 + minor (`7.1` is 71).
    pub version: u32,
    /// The number of `.target sm_NN`.
    pub target: u32,
    pub entries: Vec<Entry>,
    /// What the instruction needing the highest architecture needs, if any instruction needs
    /// more than sm_70 (every entry's `needs`, the highest).
    pub needs: Option<Needs>,
}

/// What a feature of PTX needs: an architecture (`sm`, as major * 10 + minor) and a PTX ISA
/// version (major * 10 + minor), from the "PTX ISA notes" and "Target ISA notes" of the PTX
/// ISA manual; `what` names the feature as ptxas does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Needs {
    pub what: &'static str,
    pub sm: u32,
    pub isa: u32,
    /// Where it first appears: "fused_assign_bf16, line 141".
    pub at: String,
}

/// The PTX ISA version each architecture needs at least in `.target` (the PTX ISA manual,
/// ".target", Target ISA notes): sm_70 came with PTX ISA 6.0, sm_80 with 7.0, sm_90 with 7.8.
/// Architectures not listed are not checked.
const TARGET_ISA: [(u32, u32); 8] = [
    (70, 60),
    (72, 61),
    (75, 63),
    (80, 70),
    (86, 71),
    (87, 74),
    (89, 78),
    (90, 78),
];

/// What an instruction of the subset needs beyond sm_70 and PTX ISA 6.0, if anything. Only the
/// bf16 conversions do: `cvt.rn.bf16.f32` was introduced in PTX ISA 7.0 and `cvt.f32.bf16` in
/// 7.1, and both require sm_80 ("cvt with .bf16 requires sm_80 or higher"). The f16
/// conversions, f32 arithmetic, integer, memory and control instructions of the subset date
/// from PTX ISA 1.x and sm_1x/2x.
fn needs(op: &Op) -> Option<(&'static str, u32, u32)> {
    match op {
        Op::Cvt(Cvt::Bf16FromF32, ..) => Some(("cvt.rn.bf16.f32 (cvt with .bf16)", 80, 70)),
        Op::Cvt(Cvt::F32FromBf16, ..) => Some(("cvt.f32.bf16 (cvt with .bf16)", 80, 71)),
        _ => None,
    }
}

/// `7.1` as 71; only single-digit minors exist.
fn parse_version(v: &str) -> Option<u32> {
    let (major, minor) = v.trim().split_once('.')?;
    let (major, minor): (u32, u32) = (major.parse().ok()?, minor.parse().ok()?);
    (minor < 10).then_some(major * 10 + minor)
}

/// `sm_80` (or `sm_90a`, an architecture-specific target) as 80.
fn parse_target(t: &str) -> Option<u32> {
    let first = t.split(',').next()?.trim();
    let digits = first.strip_prefix("sm_")?.trim_end_matches(['a', 'f']);
    digits.parse().ok()
}

impl Module {
    /// Parses `text`; any directive, instruction or operand outside the supported subset is an
    /// error naming its line.
    pub fn parse(text: &str) -> Result<Module> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.split("//").next().unwrap_or("").trim()))
            .filter(|(_, l)| !l.is_empty())
            .peekable();
        let mut entries = Vec::new();
        let (mut version, mut target) = (None, None);
        while let Some((line, l)) = lines.next() {
            let at = || format!("line {line}: `{l}`");
            ensure!(
                !l.contains("/*"),
                "{}: block comments are not supported",
                at()
            );
            if let Some(v) = l.strip_prefix(".version ") {
                ensure!(version.is_none(), "{}: a second .version", at());
                version =
                    Some(parse_version(v).with_context(|| format!("{}: bad .version", at()))?);
            } else if let Some(t) = l.strip_prefix(".target ") {
                ensure!(target.is_none(), "{}: a second .target", at());
                let sm = parse_target(t).with_context(|| format!("{}: bad .target", at()))?;
                let v = version.with_context(|| format!("{}: .target before .version", at()))?;
                if let Some(&(_, isa)) = TARGET_ISA.iter().find(|(a, _)| *a == sm) {
                    ensure!(
                        v >= isa,
                        "{}: .target sm_{sm} needs PTX ISA {}.{} or newer, and the module's \
                         .version is {}.{}",
                        at(),
                        isa / 10,
                        isa % 10,
                        v / 10,
                        v % 10
                    );
                }
                target = Some(sm);
            } else if let Some(a) = l.strip_prefix(".address_size ") {
                ensure!(a.trim() == "64", "{}: only 64-bit addresses", at());
            } else if l.starts_with(".visible .entry ") || l.starts_with(".entry ") {
                // The header runs to the closing parenthesis, then comes the body in braces.
                let mut header = l.to_owned();
                while !header.contains(')') {
                    let (_, next) = lines
                        .next()
                        .with_context(|| format!("{}: unterminated .entry header", at()))?;
                    header.push(' ');
                    header.push_str(next);
                }
                let (Some(version), Some(target)) = (version, target) else {
                    bail!(
                        "{}: `.version` and `.target` must come before the first entry",
                        at()
                    );
                };
                let (name, params) = parse_header(&header).with_context(at)?;
                match lines.next() {
                    Some((_, "{")) => {}
                    other => bail!("{}: expected `{{` after the header, got {other:?}", at()),
                }
                let mut body = Vec::new();
                loop {
                    match lines.next() {
                        Some((_, "}")) => break,
                        Some(b) => body.push(b),
                        None => bail!("{}: the body of {name} has no closing `}}`", at()),
                    }
                }
                entries.push(parse_body(name, params, &body, (version, target))?);
            } else {
                bail!("{}: unsupported module-level statement", at());
            }
        }
        let (Some(version), Some(target)) = (version, target) else {
            bail!("the module has no `.version` or no `.target`");
        };
        let needs = entries
            .iter()
            .flat_map(|e| &e.needs)
            .max_by_key(|n| (n.sm, n.isa))
            .cloned();
        Ok(Module {
            version,
            target,
            entries,
            needs,
        })
    }

    /// The entry called `name`.
    pub fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| anyhow!("no .entry {name} in the module"))
    }
}

/// `.visible .entry NAME(.param .TY name, ...)`: the name and the parameters, laid out in order,
/// each aligned to its size.
fn parse_header(header: &str) -> Result<(String, Vec<Param>)> {
    let rest = header
        .trim_start_matches(".visible")
        .trim_start()
        .strip_prefix(".entry")
        .context("expected .entry")?;
    let (name, rest) = rest.split_once('(').context("expected `(`")?;
    let (list, tail) = rest.split_once(')').context("expected `)`")?;
    ensure!(tail.trim().is_empty(), "text after the parameter list");
    let mut params: Vec<Param> = Vec::new();
    let mut offset = 0u64;
    for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let words: Vec<&str> = p.split_whitespace().collect();
        let [".param", ty, pname] = words[..] else {
            bail!("unsupported parameter `{p}`");
        };
        let ty = ty
            .strip_prefix('.')
            .and_then(Ty::parse)
            .with_context(|| format!("unsupported parameter type in `{p}`"))?;
        offset = offset.next_multiple_of(ty.bytes());
        params.push(Param {
            name: pname.to_owned(),
            ty,
            offset,
        });
        offset += ty.bytes();
    }
    Ok((name.trim().to_owned(), params))
}

/// The statements of one body: `.reg` declarations, labels and instructions. Every instruction
/// must be available at the module's `(version, target)`.
fn parse_body(
    name: String,
    params: Vec<Param>,
    body: &[(usize, &str)],
    (version, target): (u32, u32),
) -> Result<Entry> {
    let mut entry_needs: Option<Needs> = None;
    let mut p = BodyParser {
        params,
        regs: Vec::new(),
        reg_index: HashMap::new(),
    };
    let mut code: Vec<Instr> = Vec::new();
    let mut labels: HashMap<String, usize> = HashMap::new();
    let mut branches: Vec<(usize, String)> = Vec::new(); // (instruction index, label)
    for &(line, l) in body {
        let at = || format!("{name}, line {line}: `{l}`");
        let mut rest = l;
        // A label, alone or before a statement.
        if let Some((label, after)) = rest.split_once(':') {
            if is_ident(label) {
                ensure!(
                    labels.insert(label.to_owned(), code.len()).is_none(),
                    "{}: label {label} defined twice",
                    at()
                );
                rest = after.trim();
            }
        }
        if rest.is_empty() {
            continue;
        }
        ensure!(
            rest.ends_with(';'),
            "{}: a statement must end with `;` on its line",
            at()
        );
        for stmt in rest.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            if let Some(decl) = stmt.strip_prefix(".reg ") {
                p.declare(decl).with_context(at)?;
            } else if stmt.starts_with('.') {
                bail!(
                    "{}: unsupported directive (the emulator has no shared, local or constant \
                     memory)",
                    at()
                );
            } else {
                let (guard, op, label) = p.instruction(stmt).with_context(at)?;
                if let Some((what, sm, isa)) = needs(&op) {
                    // As ptxas says it: "Feature 'cvt with .bf16' requires .target sm_80 or
                    // higher".
                    ensure!(
                        sm <= target,
                        "{}: {what} requires .target sm_{sm} or higher, and the module is \
                         .target sm_{target}",
                        at()
                    );
                    ensure!(
                        isa <= version,
                        "{}: {what} requires PTX ISA {}.{} or newer, and the module's .version \
                         is {}.{}",
                        at(),
                        isa / 10,
                        isa % 10,
                        version / 10,
                        version % 10
                    );
                    if entry_needs
                        .as_ref()
                        .is_none_or(|n| (n.sm, n.isa) < (sm, isa))
                    {
                        entry_needs = Some(Needs {
                            what,
                            sm,
                            isa,
                            at: format!("{name}, line {line}"),
                        });
                    }
                }
                if let Some(label) = label {
                    branches.push((code.len(), label));
                }
                code.push(Instr {
                    guard,
                    op,
                    line,
                    text: stmt.to_owned(),
                });
            }
        }
    }
    for (i, label) in branches {
        let target = *labels
            .get(&label)
            .with_context(|| format!("{name}, line {}: no label {label}", code[i].line))?;
        code[i].op = Op::Bra(target);
    }
    Ok(Entry {
        name,
        params: p.params,
        regs: p.regs,
        code,
        needs: entry_needs,
    })
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
}

/// What a source operand must be.
#[derive(Clone, Copy)]
enum Want {
    /// An integer register of this width, or an integer immediate that fits.
    Int(u32),
    /// An f32 (or 32-bit) register, or an immediate `0fXXXXXXXX`.
    F32,
}

impl Want {
    fn of(ty: Ty) -> Want {
        match ty {
            Ty::F32 => Want::F32,
            t => Want::Int(t.bits()),
        }
    }
}

struct BodyParser {
    params: Vec<Param>,
    regs: Vec<(String, u32)>,
    reg_index: HashMap<String, Reg>,
}

impl BodyParser {
    /// `.pred %p, %q` or `.f32 %g<4>` (which declares %g0 .. %g3).
    fn declare(&mut self, decl: &str) -> Result<()> {
        let (ty, list) = decl
            .trim()
            .split_once(char::is_whitespace)
            .context("bad .reg")?;
        let bits = match ty {
            ".pred" => 1,
            _ => ty
                .strip_prefix('.')
                .and_then(Ty::parse)
                .with_context(|| format!("unsupported register type {ty}"))?
                .bits(),
        };
        for item in list.split(',').map(str::trim) {
            let names: Vec<String> = match item.split_once('<') {
                Some((base, count)) => {
                    let count: usize = count
                        .strip_suffix('>')
                        .and_then(|c| c.parse().ok())
                        .with_context(|| format!("bad register range {item}"))?;
                    (0..count).map(|i| format!("{base}{i}")).collect()
                }
                None => vec![item.to_owned()],
            };
            for n in names {
                ensure!(
                    n.starts_with('%') && is_ident(&n[1..]),
                    "bad register name {n}"
                );
                let idx = Reg::try_from(self.regs.len()).context("too many registers")?;
                ensure!(
                    self.reg_index.insert(n.clone(), idx).is_none(),
                    "register {n} declared twice"
                );
                self.regs.push((n, bits));
            }
        }
        Ok(())
    }

    /// A register operand of exactly `bits` (1: predicate).
    fn reg(&self, s: &str, bits: u32) -> Result<Reg> {
        let &r = self
            .reg_index
            .get(s)
            .with_context(|| format!("`{s}` is not a declared register"))?;
        let have = self.regs[usize::from(r)].1;
        ensure!(
            have == bits,
            "{s} is {} but the instruction needs {}",
            width_name(have),
            width_name(bits)
        );
        Ok(r)
    }

    /// A source operand: a register of the wanted width or a fitting immediate.
    fn src(&self, s: &str, want: Want) -> Result<Src> {
        if s.starts_with('%') {
            let bits = match want {
                Want::Int(b) => b,
                Want::F32 => 32,
            };
            return Ok(Src::Reg(self.reg(s, bits)?));
        }
        match want {
            Want::F32 => {
                let hex = s
                    .strip_prefix("0f")
                    .or_else(|| s.strip_prefix("0F"))
                    .filter(|h| h.len() == 8)
                    .with_context(|| format!("f32 immediate `{s}` must be 0fXXXXXXXX"))?;
                Ok(Src::Imm(u64::from(u32::from_str_radix(hex, 16)?)))
            }
            Want::Int(bits) => {
                let (neg, digits) = match s.strip_prefix('-') {
                    Some(d) => (true, d),
                    None => (false, s),
                };
                let v = match digits
                    .strip_prefix("0x")
                    .or_else(|| digits.strip_prefix("0X"))
                {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => digits.parse::<u64>(),
                }
                .with_context(|| format!("bad integer immediate `{s}`"))?;
                let mask = mask(bits);
                ensure!(v <= mask, "immediate `{s}` does not fit in {bits} bits");
                Ok(Src::Imm(if neg { v.wrapping_neg() & mask } else { v }))
            }
        }
    }

    /// `[%reg]`, `[%reg+imm]` or `[%reg-imm]`, with a 64-bit register.
    fn address(&self, s: &str) -> Result<(Reg, i64)> {
        let inner = s
            .strip_prefix('[')
            .and_then(|s| s.strip_suffix(']'))
            .with_context(|| format!("`{s}` is not an address"))?
            .trim();
        let (reg, off) = match inner.find(['+', '-']) {
            Some(i) => {
                let off: i64 = inner[i + 1..]
                    .trim()
                    .parse()
                    .with_context(|| format!("bad offset in `{s}`"))?;
                let off = if &inner[i..=i] == "-" { -off } else { off };
                (inner[..i].trim(), off)
            }
            None => (inner, 0),
        };
        Ok((self.reg(reg, 64)?, off))
    }

    /// `{%a, %b, ...}` (2 or 4 items) when `vec` > 1, else one operand.
    fn items(s: &str, vec: usize) -> Result<Vec<&str>> {
        if vec == 1 {
            return Ok(vec![s]);
        }
        let inner = s
            .strip_prefix('{')
            .and_then(|s| s.strip_suffix('}'))
            .with_context(|| format!("expected a {{...}} vector of {vec}, got `{s}`"))?;
        let items: Vec<&str> = inner.split(',').map(str::trim).collect();
        ensure!(items.len() == vec, "expected {vec} items in `{s}`");
        Ok(items)
    }

    /// One instruction: its guard, the decoded op, and the label it branches to (if `bra`).
    fn instruction(&self, stmt: &str) -> Result<(Guard, Op, Option<String>)> {
        let (guard, stmt) = match stmt.strip_prefix('@') {
            Some(g) => {
                let (p, rest) = g
                    .split_once(char::is_whitespace)
                    .context("a guard must be followed by an instruction")?;
                let (p, negated) = match p.strip_prefix('!') {
                    Some(p) => (p, true),
                    None => (p, false),
                };
                (Some((self.reg(p, 1)?, negated)), rest.trim())
            }
            None => (None, stmt),
        };
        let (opcode, rest) = stmt.split_once(char::is_whitespace).unwrap_or((stmt, ""));
        let ops = split_operands(rest);
        let n = |want: usize| -> Result<()> {
            ensure!(
                ops.len() == want,
                "{opcode} takes {want} operands, got {}",
                ops.len()
            );
            Ok(())
        };
        let parts: Vec<&str> = opcode.split('.').collect();
        let op = match parts[..] {
            ["add" | "sub" | "mul" | "div", "rn", "f32"] => {
                n(3)?;
                let f = match parts[0] {
                    "add" => FloatOp::Add,
                    "sub" => FloatOp::Sub,
                    "mul" => FloatOp::Mul,
                    _ => FloatOp::Div,
                };
                Op::Float(
                    f,
                    self.reg(ops[0], 32)?,
                    self.src(ops[1], Want::F32)?,
                    self.src(ops[2], Want::F32)?,
                )
            }
            ["sqrt", "rn", "f32"] | ["neg", "f32"] => {
                n(2)?;
                let (d, a) = (self.reg(ops[0], 32)?, self.src(ops[1], Want::F32)?);
                if parts[0] == "sqrt" {
                    Op::Sqrt(d, a)
                } else {
                    Op::Neg(d, a)
                }
            }
            ["add" | "sub" | "min", "u32" | "u64"]
            | ["shl" | "and" | "or", "b32" | "b64"]
            | ["shr", "u32" | "u64" | "b32" | "b64"] => {
                n(3)?;
                let bits = Ty::parse(parts[1]).unwrap().bits();
                let int = match parts[0] {
                    "add" => IntOp::Add,
                    "sub" => IntOp::Sub,
                    "min" => IntOp::Min,
                    "shl" => IntOp::Shl,
                    "shr" => IntOp::Shr,
                    "and" => IntOp::And,
                    _ => IntOp::Or,
                };
                // The shift amount is a u32 whatever the type.
                let b_bits = if matches!(int, IntOp::Shl | IntOp::Shr) {
                    32
                } else {
                    bits
                };
                Op::Int(
                    int,
                    bits,
                    self.reg(ops[0], bits)?,
                    self.src(ops[1], Want::Int(bits))?,
                    self.src(ops[2], Want::Int(b_bits))?,
                )
            }
            ["mul", "wide", "u32"] => {
                n(3)?;
                Op::MulWide(
                    self.reg(ops[0], 64)?,
                    self.src(ops[1], Want::Int(32))?,
                    self.src(ops[2], Want::Int(32))?,
                )
            }
            ["mov", ty] => {
                n(2)?;
                let ty = Ty::parse(ty).with_context(|| format!("unsupported {opcode}"))?;
                let d = self.reg(ops[0], ty.bits())?;
                match special(ops[1]) {
                    Some(s) => {
                        ensure!(ty == Ty::U32, "special registers are read with mov.u32");
                        Op::MovSpecial(d, s)
                    }
                    None => Op::Mov(d, self.src(ops[1], Want::of(ty))?),
                }
            }
            ["cvta", "to", "global", "u64"] => {
                n(2)?;
                // Generic and global addresses of device allocations coincide.
                Op::Mov(self.reg(ops[0], 64)?, self.src(ops[1], Want::Int(64))?)
            }
            ["cvt", ..] => {
                n(2)?;
                let (cvt, d_bits, a_want) = match parts[1..] {
                    ["u64", "u32"] => (Cvt::U64FromU32, 64, Want::Int(32)),
                    ["f32", "f16"] => (Cvt::F32FromF16, 32, Want::Int(16)),
                    ["f32", "bf16"] => (Cvt::F32FromBf16, 32, Want::Int(16)),
                    ["rn", "f16", "f32"] => (Cvt::F16FromF32, 16, Want::F32),
                    ["rn", "bf16", "f32"] => (Cvt::Bf16FromF32, 16, Want::F32),
                    _ => bail!("unsupported conversion {opcode}"),
                };
                Op::Cvt(cvt, self.reg(ops[0], d_bits)?, self.src(ops[1], a_want)?)
            }
            ["setp", cmp, ty] => {
                n(3)?;
                let cmp = match cmp {
                    "eq" => Cmp::Eq,
                    "ne" => Cmp::Ne,
                    "lt" => Cmp::Lt,
                    "le" => Cmp::Le,
                    "gt" => Cmp::Gt,
                    "ge" => Cmp::Ge,
                    _ => bail!("unsupported comparison {opcode}"),
                };
                let ty = Ty::parse(ty)
                    .filter(|t| *t != Ty::B16)
                    .with_context(|| format!("unsupported {opcode}"))?;
                Op::Setp(
                    cmp,
                    ty,
                    self.reg(ops[0], 1)?,
                    self.src(ops[1], Want::of(ty))?,
                    self.src(ops[2], Want::of(ty))?,
                )
            }
            ["selp", ty] => {
                n(4)?;
                let ty = Ty::parse(ty).with_context(|| format!("unsupported {opcode}"))?;
                Op::Selp(
                    self.reg(ops[0], ty.bits())?,
                    self.src(ops[1], Want::of(ty))?,
                    self.src(ops[2], Want::of(ty))?,
                    self.reg(ops[3], 1)?,
                )
            }
            ["ld", "param", ty] => {
                n(2)?;
                let ty = Ty::parse(ty).with_context(|| format!("unsupported {opcode}"))?;
                let name = ops[1]
                    .strip_prefix('[')
                    .and_then(|s| s.strip_suffix(']'))
                    .with_context(|| format!("`{}` is not [param]", ops[1]))?
                    .trim();
                let p = self
                    .params
                    .iter()
                    .find(|p| p.name == name)
                    .with_context(|| format!("no parameter {name}"))?;
                ensure!(
                    p.ty.bits() == ty.bits(),
                    "{opcode} of the {}-bit parameter {name}",
                    p.ty.bits()
                );
                Op::LdParam(self.reg(ops[0], ty.bits())?, ty, p.offset)
            }
            ["ld" | "st", "global", ..] => {
                n(2)?;
                let (vec, ty) = match parts[2..] {
                    [ty] => (1, ty),
                    ["v2", ty] => (2, ty),
                    ["v4", ty] => (4, ty),
                    _ => bail!("unsupported {opcode}"),
                };
                let ty = Ty::parse(ty).with_context(|| format!("unsupported {opcode}"))?;
                if parts[0] == "ld" {
                    let dsts = Self::items(ops[0], vec)?
                        .into_iter()
                        .map(|r| self.reg(r, ty.bits()))
                        .collect::<Result<_>>()?;
                    let (base, off) = self.address(ops[1])?;
                    Op::LdGlobal(ty, dsts, base, off)
                } else {
                    let (base, off) = self.address(ops[0])?;
                    let srcs = Self::items(ops[1], vec)?
                        .into_iter()
                        .map(|s| self.src(s, Want::of(ty)))
                        .collect::<Result<_>>()?;
                    Op::StGlobal(ty, srcs, base, off)
                }
            }
            ["bra"] | ["bra", "uni"] => {
                n(1)?;
                ensure!(is_ident(ops[0]), "bad label `{}`", ops[0]);
                return Ok((guard, Op::Bra(usize::MAX), Some(ops[0].to_owned())));
            }
            ["ret"] => {
                n(0)?;
                Op::Ret
            }
            _ => bail!("unsupported instruction {opcode}"),
        };
        Ok((guard, op, None))
    }
}

/// Operands split at the commas outside `[]` and `{}`.
fn split_operands(s: &str) -> Vec<&str> {
    let s = s.trim();
    if s.is_empty() {
        return vec![];
    }
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' | '{' => depth += 1,
            ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim());
    out
}

/// `%tid.x` and friends.
fn special(s: &str) -> Option<Special> {
    let (name, dim) = s.split_once('.')?;
    let dim = ["x", "y", "z"].iter().position(|d| *d == dim)?;
    Some(match name {
        "%tid" => Special::Tid(dim),
        "%ntid" => Special::Ntid(dim),
        "%ctaid" => Special::Ctaid(dim),
        "%nctaid" => Special::Nctaid(dim),
        _ => return None,
    })
}

/// The all-ones value of `bits` bits (1 to 64).
pub fn mask(bits: u32) -> u64 {
    u64::MAX >> (64 - bits)
}

fn width_name(bits: u32) -> String {
    if bits == 1 {
        "a predicate".to_owned()
    } else {
        format!("{bits}-bit")
    }
}

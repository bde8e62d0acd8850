//! Unit tests of the interpreter itself, on small hand-written kernels.

use super::*;
use anyhow::Result;
use kvstore::__internal::kernels::{self, RuleKind};
use rand::{Rng, SeedableRng};

const HEAD: &str = ".version 7.0\n.target sm_70\n.address_size 64\n";

/// `out[i] = sqrt(in[i]) / s + 1.5` for `i < n`, with `i = ctaid.x * ntid.x + tid.x`.
const SCALE: &str = "
.visible .entry scale(
    .param .u64 out,
    .param .u64 in,
    .param .u32 n,
    .param .f32 s
)
{
    .reg .pred %p;
    .reg .b32 %t, %c, %nt, %n32;
    .reg .b64 %i, %t64, %n, %o, %a;
    .reg .f32 %x, %s;
    mov.u32 %t, %tid.x;
    mov.u32 %c, %ctaid.x;
    mov.u32 %nt, %ntid.x;
    mul.wide.u32 %i, %c, %nt;
    cvt.u64.u32 %t64, %t;
    add.u64 %i, %i, %t64;
    ld.param.u32 %n32, [n];
    cvt.u64.u32 %n, %n32;
    setp.ge.u64 %p, %i, %n;
    @%p bra END;
    ld.param.u64 %a, [in];
    ld.param.u64 %o, [out];
    shl.b64 %i, %i, 2;
    add.u64 %a, %a, %i;
    add.u64 %o, %o, %i;
    ld.global.f32 %x, [%a];
    ld.param.f32 %s, [s];
    sqrt.rn.f32 %x, %x;
    div.rn.f32 %x, %x, %s;
    add.rn.f32 %x, %x, 0f3FC00000;
    st.global.f32 [%o], %x;
END:
    ret;
}
";

fn module(body: &str) -> Result<Module> {
    Module::parse(&format!("{HEAD}{body}"))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The line number of `stmt` in the module built from `body`.
fn line_of(body: &str, stmt: &str) -> usize {
    let text = format!("{HEAD}{body}");
    1 + text.lines().position(|l| l.trim() == stmt).expect(stmt)
}

fn error_of<T: std::fmt::Debug>(r: Result<T>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

#[test]
fn runs_a_small_kernel_exactly() -> Result<()> {
    let m = module(SCALE)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let n = 7; // 2 blocks of 4 threads: the last thread is past the end and must not store
    let input: Vec<f32> = (0..n).map(|_| rng.gen_range(0.0..100.0)).collect();
    let s: f32 = rng.gen_range(0.5..3.0);
    let mut mem = Memory::default();
    let a = mem.alloc(&f32s(&input));
    let o = mem.alloc(&f32s(&vec![f32::NAN; n]));
    let args = [Arg::U64(o), Arg::U64(a), Arg::U32(n as u32), Arg::F32(s)];
    launch(m.entry("scale")?, &mut mem, (2, 1, 1), (4, 1, 1), &args)?;
    let out = mem.read(o, 4 * n)?;
    for (i, x) in input.iter().enumerate() {
        let got = f32::from_le_bytes(out[4 * i..4 * i + 4].try_into()?);
        let want = x.sqrt() / s + 1.5;
        assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
    }
    Ok(())
}

#[test]
fn counts_the_blocks_that_did_no_work() -> Result<()> {
    let m = module(SCALE)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    // n elements need ceil(n / 4) blocks of 4; the rest of the grid returns at the bounds check.
    let n: usize = rng.gen_range(5..40);
    let needed = n.div_ceil(4) as u64;
    let grid = rng.gen_range(needed as u32..needed as u32 + 20);
    let mut mem = Memory::default();
    let a = mem.alloc(&f32s(&vec![4.0; n]));
    let o = mem.alloc(&f32s(&vec![f32::NAN; n]));
    let args = [Arg::U64(o), Arg::U64(a), Arg::U32(n as u32), Arg::F32(2.0)];
    let blocks = launch(m.entry("scale")?, &mut mem, (grid, 1, 1), (4, 1, 1), &args)?;
    assert_eq!(blocks.launched, u64::from(grid), "n {n}");
    assert_eq!(blocks.idle, u64::from(grid) - needed, "n {n}, grid {grid}");
    Ok(())
}

/// Loads an f32, stores it as f16 and as bf16, and stores the f16 widened back.
const CVT: &str = "
.visible .entry cvt(
    .param .u64 p
)
{
    .reg .b64 %a;
    .reg .f32 %x, %y;
    .reg .b16 %h, %b;
    ld.param.u64 %a, [p];
    ld.global.f32 %x, [%a];
    cvt.rn.f16.f32 %h, %x;
    cvt.rn.bf16.f32 %b, %x;
    cvt.f32.f16 %y, %h;
    st.global.b16 [%a+4], %h;
    st.global.b16 [%a+6], %b;
    st.global.f32 [%a+8], %y;
    ret;
}
";

#[test]
fn half_conversions_round_to_nearest_even() -> Result<()> {
    // cvt.rn.bf16.f32 needs sm_80 and PTX ISA 7.0.
    let m = Module::parse(&format!("{}{CVT}", HEAD.replace("sm_70", "sm_80")))?;
    // (input, f16 bits, bf16 bits): ties go to the even neighbour.
    let cases = [
        (1.0 + 2f32.powi(-11), 0x3c00, 0x3f80), // f16 tie, down to even
        (1.0 + 3.0 * 2f32.powi(-11), 0x3c02, 0x3f80), // f16 tie, up to even
        (1.0 + 2f32.powi(-8), 0x3c04, 0x3f80),  // bf16 tie, down to even
        (1.0 + 3.0 * 2f32.powi(-8), 0x3c0c, 0x3f82), // bf16 tie, up to even
        (-65520.0, 0xfc00, 0xc780),             // f16 overflows to -inf
    ];
    for (x, h, b) in cases {
        let mut mem = Memory::default();
        let p = mem.alloc(&[x.to_le_bytes(), [0; 4], [0; 4]].concat());
        launch(
            m.entry("cvt")?,
            &mut mem,
            (1, 1, 1),
            (1, 1, 1),
            &[Arg::U64(p)],
        )?;
        let out = mem.read(p + 4, 8)?;
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), h, "f16 of {x}");
        assert_eq!(u16::from_le_bytes([out[2], out[3]]), b, "bf16 of {x}");
        let back = f32::from_le_bytes(out[4..8].try_into()?);
        assert_eq!(back, half::f16::from_bits(h).to_f32(), "f16 {h:#x} widened");
    }
    Ok(())
}

#[test]
fn comparisons_are_ordered_and_integers_wrap() -> Result<()> {
    // p[0] = NaN, p[1] = 1.0 (f32); writes six u32 results at p[2..8].
    let m = module(
        "
.visible .entry ops(
    .param .u64 p
)
{
    .reg .pred %q;
    .reg .b32 %r, %z;
    .reg .b64 %a, %w;
    .reg .f32 %x, %y;
    ld.param.u64 %a, [p];
    ld.global.f32 %x, [%a];
    ld.global.f32 %y, [%a+4];
    setp.ne.f32 %q, %x, %y;
    selp.u32 %r, 1, 0, %q;
    st.global.u32 [%a+8], %r;
    setp.gt.f32 %q, %x, %y;
    selp.u32 %r, 1, 0, %q;
    st.global.u32 [%a+12], %r;
    setp.ge.f32 %q, %y, %y;
    selp.u32 %r, 1, 0, %q;
    st.global.u32 [%a+16], %r;
    mov.u32 %z, 0;
    sub.u32 %r, %z, 1;
    st.global.u32 [%a+20], %r;
    mov.u64 %w, 1;
    shl.b64 %w, %w, 64;
    st.global.u64 [%a+24], %w;
    ret;
}
",
    )?;
    let mut mem = Memory::default();
    let p = mem.alloc(&[f32s(&[f32::NAN, 1.0]), vec![0xab; 24]].concat());
    launch(
        m.entry("ops")?,
        &mut mem,
        (1, 1, 1),
        (1, 1, 1),
        &[Arg::U64(p)],
    )?;
    let out = mem.read(p + 8, 24)?;
    let word = |i: usize| u32::from_le_bytes(out[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(word(0), 0, "NaN != 1 is false (ordered)");
    assert_eq!(word(1), 0, "NaN > 1 is false");
    assert_eq!(word(2), 1, "1 >= 1");
    assert_eq!(word(3), u32::MAX, "0 - 1 wraps in 32 bits");
    assert_eq!(&out[16..24], &[0; 8], "a shift by the width gives 0");
    Ok(())
}

#[test]
fn an_out_of_bounds_store_is_reported() -> Result<()> {
    let m = module(SCALE)?;
    let mut mem = Memory::default();
    let a = mem.alloc(&f32s(&[1.0; 8]));
    let o = mem.alloc(&f32s(&[0.0; 5])); // 5 elements, but n says 6
    let args = [Arg::U64(o), Arg::U64(a), Arg::U32(6), Arg::F32(1.0)];
    let err = error_of(launch(
        m.entry("scale")?,
        &mut mem,
        (1, 1, 1),
        (8, 1, 1),
        &args,
    ));
    let at = o + 20;
    assert!(err.contains("out of bounds"), "{err}");
    assert!(err.contains("st.global.f32 [%o], %x"), "{err}");
    assert!(err.contains(&format!("{at:#x}")), "{err}");
    assert!(err.contains("thread [5, 0, 0]"), "{err}");
    Ok(())
}

#[test]
fn a_misaligned_vector_load_is_reported() -> Result<()> {
    let text = "
.visible .entry v4(
    .param .u64 p,
    .param .u64 q
)
{
    .reg .b64 %a, %b;
    .reg .f32 %x<4>;
    ld.param.u64 %a, [p];
    ld.param.u64 %b, [q];
    ld.global.v4.f32 {%x0, %x1, %x2, %x3}, [%a];
    st.global.v4.f32 [%b], {%x0, %x1, %x2, %x3};
    ret;
}
";
    let m = module(text)?;
    let entry = m.entry("v4")?;
    let mut mem = Memory::default();
    let p = mem.alloc(&f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]));
    let q = mem.alloc(&f32s(&[0.0; 4]));
    // Aligned: copies four floats.
    launch(
        entry,
        &mut mem,
        (1, 1, 1),
        (1, 1, 1),
        &[Arg::U64(p), Arg::U64(q)],
    )?;
    assert_eq!(mem.read(q, 16)?, f32s(&[1.0, 2.0, 3.0, 4.0]));
    // 4 bytes in: inside the allocation, but not 16-byte aligned.
    let args = [Arg::U64(p + 4), Arg::U64(q)];
    let err = error_of(launch(entry, &mut mem, (1, 1, 1), (1, 1, 1), &args));
    assert!(err.contains("misaligned load of 16 bytes"), "{err}");
    assert!(err.contains(&format!("{:#x}", p + 4)), "{err}");
    let line = line_of(text, "ld.global.v4.f32 {%x0, %x1, %x2, %x3}, [%a];");
    assert!(err.contains(&format!("line {line}:")), "{err}");
    Ok(())
}

#[test]
fn two_threads_storing_one_address_is_a_race() -> Result<()> {
    let m = module(
        "
.visible .entry same(
    .param .u64 p
)
{
    .reg .b64 %a;
    .reg .b32 %t;
    ld.param.u64 %a, [p];
    mov.u32 %t, %tid.x;
    st.global.u32 [%a], %t;
    ret;
}
",
    )?;
    let mut mem = Memory::default();
    let p = mem.alloc(&[0; 4]);
    launch(
        m.entry("same")?,
        &mut mem,
        (1, 1, 1),
        (1, 1, 1),
        &[Arg::U64(p)],
    )?;
    let err = error_of(launch(
        m.entry("same")?,
        &mut mem,
        (1, 1, 1),
        (2, 1, 1),
        &[Arg::U64(p)],
    ));
    assert!(err.contains("race"), "{err}");
    Ok(())
}

#[test]
fn reading_an_unwritten_register_is_an_error() -> Result<()> {
    let m = module(
        "
.visible .entry uninit(
    .param .u64 p
)
{
    .reg .b64 %a;
    .reg .f32 %x, %y;
    ld.param.u64 %a, [p];
    add.rn.f32 %y, %x, %x;
    st.global.f32 [%a], %y;
    ret;
}
",
    )?;
    let mut mem = Memory::default();
    let p = mem.alloc(&[0; 4]);
    let err = error_of(launch(
        m.entry("uninit")?,
        &mut mem,
        (1, 1, 1),
        (1, 1, 1),
        &[Arg::U64(p)],
    ));
    assert!(err.contains("reads %x before"), "{err}");
    Ok(())
}

#[test]
fn unsupported_ptx_is_rejected_with_its_line() {
    // Each replaces the `sqrt` line of SCALE.
    let sqrt = "sqrt.rn.f32 %x, %x;";
    let at = format!("line {}:", line_of(SCALE, sqrt));
    for (line, why) in [
        (
            "sqrt.approx.f32 %x, %x;",
            "unsupported instruction sqrt.approx.f32",
        ),
        ("add.f32 %x, %x, %s;", "unsupported instruction add.f32"),
        (
            "add.rn.ftz.f32 %x, %x, %s;",
            "unsupported instruction add.rn.ftz.f32",
        ),
        (
            "fma.rn.f32 %x, %x, %s, %s;",
            "unsupported instruction fma.rn.f32",
        ),
        ("bar.sync 0;", "unsupported instruction bar.sync"),
        (".shared .f32 tile[256];", "unsupported directive"),
        ("add.rn.f32 %x, %x, 1.5;", "must be 0fXXXXXXXX"),
        (
            "add.u64 %x, %x, %x;",
            "%x is 32-bit but the instruction needs 64-bit",
        ),
        (
            "add.rn.f32 %x, %x, %nope;",
            "`%nope` is not a declared register",
        ),
        ("@%p bra NOWHERE;", "no label NOWHERE"),
    ] {
        let text = SCALE.replace(sqrt, line);
        let err = format!("{:#}", module(&text).expect_err(line));
        assert!(err.contains(&at), "{line}: {err}");
        assert!(err.contains(why), "{line}: {err}");
    }
}

#[test]
fn an_instruction_above_the_target_or_version_is_rejected() -> Result<()> {
    // CVT's bf16 conversion in an sm_70 module: refused as ptxas refuses it, naming the line.
    let err = format!("{:#}", module(CVT).expect_err("bf16 on sm_70"));
    let at = format!("line {}:", line_of(CVT, "cvt.rn.bf16.f32 %b, %x;"));
    assert!(err.contains(&at), "{err}");
    assert!(
        err.contains("cvt.rn.bf16.f32 (cvt with .bf16) requires .target sm_80 or higher")
            && err.contains("sm_70"),
        "{err}"
    );
    // The widening needs PTX ISA 7.1: an sm_80 module of .version 7.0 may narrow, not widen.
    let head80 = HEAD.replace("sm_70", "sm_80");
    let widen = CVT.replace("cvt.f32.f16 %y, %h;", "cvt.f32.bf16 %y, %b;");
    let err = format!(
        "{:#}",
        Module::parse(&format!("{head80}{widen}")).expect_err("ISA 7.0")
    );
    assert!(
        err.contains("cvt.f32.bf16 (cvt with .bf16) requires PTX ISA 7.1 or newer"),
        "{err}"
    );
    let m = Module::parse(&format!("{}{widen}", head80.replace("7.0", "7.1")))?;
    let needs = m.needs.expect("a bf16 conversion needs sm_80");
    assert_eq!((needs.sm, needs.isa, m.target, m.version), (80, 71, 80, 71));
    assert!(needs.at.starts_with("cvt, line "), "{}", needs.at);
    // A target its version does not know, and a module without a target.
    let err = format!(
        "{:#}",
        Module::parse(&format!("{}{SCALE}", HEAD.replace("sm_70", "sm_90"))).expect_err("7.0")
    );
    assert!(err.contains(".target sm_90 needs PTX ISA 7.8"), "{err}");
    let err = format!(
        "{:#}",
        Module::parse(&format!(".version 7.0\n{SCALE}")).expect_err("no target")
    );
    assert!(err.contains("must come before the first entry"), "{err}");
    // Nothing in SCALE needs more than sm_70.
    assert!(module(SCALE)?.needs.is_none());
    Ok(())
}

#[test]
fn every_kernel_entry_parses() -> Result<()> {
    for (stem, text) in kernels::PTX_SOURCES {
        let m = Module::parse(text).map_err(|e| e.context(format!("kernels/{stem}.ptx")))?;
        assert_eq!(m.entries.len(), RuleKind::ALL.len(), "{stem}");
        for kind in RuleKind::ALL {
            let name = format!("fused_{}_{}", kind.name(), &stem["fused_".len()..]);
            let e = m.entry(&name)?;
            // table, ntensors, chunk, then the rule's f32 scalars, at their natural offsets.
            let offsets: Vec<u64> = e.params.iter().map(|p| p.offset).collect();
            assert_eq!(offsets[..3], [0, 8, 12], "{name}");
            for (i, o) in offsets.iter().enumerate().skip(3) {
                assert_eq!(*o, 16 + 4 * (i as u64 - 3), "{name}");
            }
        }
    }
    Ok(())
}

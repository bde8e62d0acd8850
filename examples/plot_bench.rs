//! Draws BENCHMARKS.md's plot: bandwidth (algbw) vs value size for ours, MXNet and the memory
//! roof, push on the left and pull on the right.
//!
//! ```text
//! cargo run --release --example plot_bench -- PEER.json SUITE.jsonl OUT.png
//! ```
//!
//! PEER.json comes from `benches/mxnet_peer.py` (ours and MXNet, interleaved), SUITE.jsonl from
//! `bench_kv --suite` (ours next to the roof kernels, one JSON object per line). Text is drawn
//! with DejaVu Sans (`PLOT_FONT` overrides the path).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde_json::Value;

/// One line on a panel: a name, a colour and (bytes, GB/s) points.
struct Line {
    name: String,
    color: RGBColor,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

fn size_name(bytes: f64) -> String {
    let b = bytes.round() as u64;
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}K", b >> 10)
    }
}

/// Median over rounds of algbw for each size, from suite lines matching `op` and `ndev`.
fn suite_line(suite: &[Value], op: &str, ndev: u64) -> Vec<(f64, f64)> {
    let mut by: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for v in suite {
        if v["op"] == op && v["ndev"] == ndev && v["updater"] == "assign" && v["dtype"] == "float32"
        {
            if let (Some(b), Some(g)) = (v["bytes"].as_u64(), v["algbw_gbps"].as_f64()) {
                by.entry(b).or_default().push(g);
            }
        }
    }
    by.into_iter()
        .map(|(b, mut g)| {
            g.sort_by(f64::total_cmp);
            (b as f64, g[g.len() / 2])
        })
        .collect()
}

/// algbw of `who` (`ours` or `mxnet`) for plain `op` rows of the peer file.
fn peer_line(peer: &Value, op: &str, who: &str) -> Vec<(f64, f64)> {
    let key = format!("{who}_algbw_gbps");
    peer["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["workload"] == op)
        .filter_map(|r| Some((r["bytes"].as_f64()?, r[&key].as_f64()?)))
        .collect()
}

fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    lines: &[Line],
) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(11f64..29f64, (0.03f64..100f64).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("value size (bytes, 4 devices)")
        .y_desc("algbw GB/s (one value / time)")
        .x_labels(19)
        .x_label_formatter(&|x| {
            let e = x.round() as i32;
            if e % 2 == 0 {
                size_name(2f64.powi(e))
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;
    for line in lines {
        // x is log2 of the size, so ticks fall on powers of two.
        let points: Vec<(f64, f64)> = line.points.iter().map(|&(b, g)| (b.log2(), g)).collect();
        let color = line.color;
        let style = color.stroke_width(3);
        let anno = if line.dashed {
            chart.draw_series(DashedLineSeries::new(points.clone(), 10, 6, style))?
        } else {
            chart.draw_series(LineSeries::new(points.clone(), style))?
        };
        anno.label(&line.name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
        });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    Ok(())
}

/// Draws BENCHMARKS.md's bandwidth plot from the MXNet A/B and the suite run.
#[derive(Parser)]
#[command(name = "plot_bench")]
struct Options {
    /// The A/B of ours and MXNet, from benches/mxnet_peer.py.
    #[arg(value_name = "PEER.json")]
    peer: PathBuf,
    /// The suite run, from `bench_kv --suite` (one JSON object per line).
    #[arg(value_name = "SUITE.jsonl")]
    suite: PathBuf,
    /// The PNG to write.
    #[arg(value_name = "OUT.png")]
    out: PathBuf,
}

fn main() -> Result<()> {
    let Options { peer, suite, out } = Options::parse();
    let font = std::env::var("PLOT_FONT")
        .unwrap_or_else(|_| "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into());
    let bytes = std::fs::read(&font).with_context(|| format!("reading font {font}"))?;
    register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| anyhow::anyhow!("{font} is not a usable font"))?;

    let peer: Value = serde_json::from_str(&std::fs::read_to_string(peer)?)?;
    let suite: Vec<Value> = std::fs::read_to_string(suite)?
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;

    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(230, 120, 20);
    let grey = RGBColor(90, 90, 90);
    let green = RGBColor(44, 160, 44);
    let mk = |name: &str, color, dashed, points| Line {
        name: name.to_owned(),
        color,
        dashed,
        points,
    };
    let push = [
        mk(
            "roof: sum of 4 into 1 (rayon)",
            grey,
            true,
            suite_line(&suite, "roof_sum", 4),
        ),
        mk(
            "ours (suite run)",
            green,
            false,
            suite_line(&suite, "push", 4),
        ),
        mk(
            "ours (A/B with MXNet)",
            blue,
            false,
            peer_line(&peer, "push", "ours"),
        ),
        mk(
            "MXNet 1.9.1 local (A/B)",
            orange,
            false,
            peer_line(&peer, "push", "mxnet"),
        ),
    ];
    let pull = [
        mk(
            "roof: 1 into 4, fused (rayon)",
            grey,
            true,
            suite_line(&suite, "roof_bcast", 4),
        ),
        mk(
            "ours (suite run)",
            green,
            false,
            suite_line(&suite, "pull", 4),
        ),
        mk(
            "ours (A/B with MXNet)",
            blue,
            false,
            peer_line(&peer, "pull", "ours"),
        ),
        mk(
            "MXNet 1.9.1 local (A/B)",
            orange,
            false,
            peer_line(&peer, "pull", "mxnet"),
        ),
    ];

    let root = BitMapBackend::new(&out, (1600, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(800);
    panel(
        &left,
        "push: 4 values summed into the stored one (CPU)",
        &push,
    )?;
    panel(&right, "pull: stored value copied to 4 outs (CPU)", &pull)?;
    root.present()?;
    println!("wrote {}", out.display());
    Ok(())
}

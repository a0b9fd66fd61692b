//! Reports: results.json, a Markdown summary, and an HTML page with SVG
//! charts.

use std::path::{Path, PathBuf};

use super::AbReport;
use crate::error::{Result, SpecdError};

/// The Markdown summary.
pub fn markdown(r: &AbReport) -> String {
    let mut s = String::new();
    s += &format!(
        "# A/B: {} ({} prompts, {} repeat(s), max_tokens {}, temperature {}, {} threads)\n\n",
        r.dataset, r.prompts, r.repeats, r.max_tokens, r.sampling.temperature, r.threads
    );
    if r.repeats > 1 {
        s += "Each repeat ran on fresh proposer instances (no state carried between repeats).\n\n";
    }
    s += "| arm | speedup | 95% CI | tok/s | mean accepted length | acceptance | forwards/token | TTFT p50 / p95 ms | TPOT p50 / p95 ms |\n";
    s += "|---|---|---|---|---|---|---|---|---|\n";
    for a in &r.overall {
        s += &format!(
            "| {} | {:.2}x | {:.2}-{:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} / {:.1} | {:.2} / {:.2} |\n",
            a.arm, a.speedup, a.speedup_ci95.0, a.speedup_ci95.1, a.tok_per_s, a.mean_accepted_length, a.acceptance_rate,
            a.forwards_per_token, a.ttft_p50_ms, a.ttft_p95_ms, a.tpot_p50_ms, a.tpot_p95_ms
        );
    }
    s += "\n## Speedup by category\n\n| category | prompts |";
    let arms: Vec<&str> = r.overall.iter().map(|a| a.arm.as_str()).collect();
    for a in &arms {
        s += &format!(" {a} |");
    }
    s += "\n|---|---|";
    for _ in &arms {
        s += "---|";
    }
    s += "\n";
    for (c, sums) in &r.by_category {
        s += &format!(
            "| {c} | {} |",
            r.prompts_per_category.get(c).copied().unwrap_or(0)
        );
        for a in sums {
            s += &format!(
                " {:.2}x (acc len {:.2}) |",
                a.speedup, a.mean_accepted_length
            );
        }
        s += "\n";
    }
    s += "\n## Acceptance by draft position\n\n";
    for a in &r.overall {
        if !a.acceptance_by_position.is_empty() {
            let p: Vec<String> = a
                .acceptance_by_position
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect();
            s += &format!("- {}: {}\n", a.arm, p.join(", "));
        }
    }
    s += "\n## Costs (in one-token target forwards: the plain arm's mean decode step on the same prompt)\n\n";
    s +=
        "| arm | draft cost per decode step | verify cost by tokens fed (steps) |\n|---|---|---|\n";
    for a in &r.overall {
        let v: Vec<String> = a
            .verify_cost_by_tokens
            .iter()
            .map(|(k, n, c)| format!("{k}: {c:.2} ({n})"))
            .collect();
        s += &format!(
            "| {} | {:.3} | {} |\n",
            a.arm,
            a.draft_cost_per_step,
            v.join(", ")
        );
    }
    let composed: Vec<_> = r.overall.iter().filter(|a| !a.members.is_empty()).collect();
    if !composed.is_empty() {
        s += "\n## Composed proposers: drafting steps by member\n\n";
        for a in composed {
            let m: Vec<String> = a
                .members
                .iter()
                .map(|(m, st, d, acc)| {
                    format!("{m}: {st} steps, {acc}/{d} drafted tokens accepted")
                })
                .collect();
            s += &format!("- {}: {}\n", a.arm, m.join("; "));
        }
    }
    // Constrained prompts: how many outputs the constraint ended and that
    // parse, per arm (truncated by max_tokens otherwise).
    let constrained: Vec<&super::Record> =
        r.records.iter().filter(|x| x.complete.is_some()).collect();
    if !constrained.is_empty() {
        s += "\n## Constrained outputs\n\n";
        for a in &r.overall {
            let mine: Vec<_> = constrained.iter().filter(|x| x.arm == a.arm).collect();
            let ok = mine.iter().filter(|x| x.complete == Some(true)).count();
            s += &format!(
                "- {}: {ok} of {} complete and valid JSON (the rest hit max_tokens)\n",
                a.arm,
                mine.len()
            );
        }
    }
    s += "\n## Losslessness\n\n";
    if r.sampling.is_greedy() {
        if r.mismatches.is_empty() {
            s += "Every greedy arm matched plain decoding token for token.\n";
        }
    } else {
        if !r.compared.is_empty() && r.mismatches.is_empty() {
            s += &format!(
                "Sampled with one seed per prompt: the arms drafting one-hot ({}) matched plain decoding token for token (each position's token is plain decoding's draw for the seed, whatever was drafted).\n",
                r.compared.join(", ")
            );
        }
        // `overall` lists plain and every arm.
        if r.overall.len() > r.compared.len() + 1 {
            s += "The other arms' sampled outputs differ from plain decoding's by design (their rejections decide tokens); that they keep the target's distribution is what the test suite's chi-square tests check, not this run.\n";
        }
    }
    for m in &r.mismatches {
        s += &format!(
            "- FAILURE: arm {} differs from plain on prompt {} (repeat {}) at token {}\n",
            m.arm, m.prompt_id, m.repeat, m.position
        );
    }
    s
}

const COLORS: [&str; 6] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Grouped horizontal bars: one group per label, one bar per series.
fn svg_bars(
    title: &str,
    labels: &[String],
    series: &[(String, Vec<f64>)],
    unit: &str,
    reference: Option<f64>,
) -> String {
    let (row_h, bar_h, left, width) = (14.0 * series.len() as f64 + 10.0, 12.0, 170.0, 420.0);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(reference.unwrap_or(0.0), f64::max)
        .max(1e-9)
        * 1.1;
    let h = 40.0 + row_h * labels.len() as f64 + 20.0 * series.len() as f64;
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{h}' font-family='sans-serif' font-size='11'>", left + width + 80.0);
    s += &format!(
        "<text x='4' y='16' font-size='14' font-weight='bold'>{}</text>",
        esc(title)
    );
    for (li, l) in labels.iter().enumerate() {
        let y0 = 30.0 + li as f64 * row_h;
        s += &format!(
            "<text x='{}' y='{}' text-anchor='end'>{}</text>",
            left - 6.0,
            y0 + row_h / 2.0,
            esc(l)
        );
        for (si, (_, v)) in series.iter().enumerate() {
            let val = v.get(li).copied().unwrap_or(0.0);
            let w = width * val / max;
            let y = y0 + si as f64 * 14.0;
            s += &format!(
                "<rect x='{left}' y='{y}' width='{w:.1}' height='{bar_h}' fill='{}'/>",
                COLORS[si % COLORS.len()]
            );
            s += &format!(
                "<text x='{:.1}' y='{}'>{val:.2}{unit}</text>",
                left + w + 3.0,
                y + 10.0
            );
        }
    }
    if let Some(r) = reference {
        let x = left + width * r / max;
        s += &format!(
            "<line x1='{x:.1}' y1='26' x2='{x:.1}' y2='{}' stroke='#333' stroke-dasharray='4 3'/>",
            30.0 + row_h * labels.len() as f64
        );
    }
    let ly = 40.0 + row_h * labels.len() as f64;
    for (si, (name, _)) in series.iter().enumerate() {
        let y = ly + si as f64 * 18.0;
        s += &format!("<rect x='{left}' y='{y}' width='12' height='12' fill='{}'/><text x='{}' y='{}'>{}</text>", COLORS[si % COLORS.len()], left + 18.0, y + 10.0, esc(name));
    }
    s + "</svg>"
}

/// Lines over x = 1..n.
fn svg_lines(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let (w, h, left, top) = (520.0, 240.0, 50.0, 30.0);
    let n = series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='11'>", w + 160.0, h + 60.0);
    s += &format!(
        "<text x='4' y='16' font-size='14' font-weight='bold'>{}</text>",
        esc(title)
    );
    s += &format!(
        "<line x1='{left}' y1='{}' x2='{}' y2='{}' stroke='#333'/>",
        top + h,
        left + w,
        top + h
    );
    s += &format!(
        "<line x1='{left}' y1='{top}' x2='{left}' y2='{}' stroke='#333'/>",
        top + h
    );
    for t in 0..=4 {
        let y = top + h - h * t as f64 / 4.0;
        s += &format!(
            "<text x='{}' y='{y}' text-anchor='end'>{:.2}</text>",
            left - 4.0,
            t as f64 / 4.0
        );
    }
    for i in 0..n {
        let x = left + w * i as f64 / (n - 1) as f64;
        s += &format!(
            "<text x='{x}' y='{}' text-anchor='middle'>{}</text>",
            top + h + 14.0,
            i + 1
        );
    }
    for (si, (name, v)) in series.iter().enumerate() {
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(i, y)| {
                format!(
                    "{:.1},{:.1}",
                    left + w * i as f64 / (n - 1) as f64,
                    top + h - h * y.clamp(0.0, 1.0)
                )
            })
            .collect();
        let c = COLORS[si % COLORS.len()];
        s += &format!(
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            pts.join(" ")
        );
        s += &format!(
            "<rect x='{}' y='{}' width='12' height='12' fill='{c}'/><text x='{}' y='{}'>{}</text>",
            left + w + 10.0,
            top + si as f64 * 18.0,
            left + w + 26.0,
            top + si as f64 * 18.0 + 10.0,
            esc(name)
        );
    }
    s + &format!(
        "<text x='{}' y='{}' text-anchor='middle'>draft position</text></svg>",
        left + w / 2.0,
        top + h + 30.0
    )
}

/// A self-contained HTML report with SVG charts.
pub fn html(r: &AbReport) -> String {
    let cats: Vec<String> = r.by_category.keys().cloned().collect();
    let arms: Vec<String> = r.overall.iter().map(|a| a.arm.clone()).collect();
    let speed: Vec<(String, Vec<f64>)> = arms
        .iter()
        .enumerate()
        .map(|(ai, a)| {
            (
                a.clone(),
                r.by_category.values().map(|v| v[ai].speedup).collect(),
            )
        })
        .collect();
    let acc: Vec<(String, Vec<f64>)> = r
        .overall
        .iter()
        .filter(|a| !a.acceptance_by_position.is_empty())
        .map(|a| (a.arm.clone(), a.acceptance_by_position.clone()))
        .collect();
    let lat_labels: Vec<String> = arms.clone();
    let lat = vec![
        (
            "TPOT p50 (ms)".to_string(),
            r.overall.iter().map(|a| a.tpot_p50_ms).collect(),
        ),
        (
            "TPOT p95 (ms)".to_string(),
            r.overall.iter().map(|a| a.tpot_p95_ms).collect(),
        ),
        (
            "TTFT p50 (ms)".to_string(),
            r.overall.iter().map(|a| a.ttft_p50_ms).collect(),
        ),
    ];
    let md = markdown(r);
    let mut body = String::new();
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("# ") {
            body += &format!("<h1>{}</h1>", esc(h));
        } else if let Some(h) = line.strip_prefix("## ") {
            body += &format!("<h2>{}</h2>", esc(h));
        } else if line.starts_with("|---") {
        } else if line.starts_with('|') {
            let cells: Vec<String> = line
                .trim_matches('|')
                .split('|')
                .map(|c| format!("<td>{}</td>", esc(c.trim())))
                .collect();
            body += &format!("<tr>{}</tr>", cells.join(""));
        } else if !line.is_empty() {
            body += &format!("<p>{}</p>", esc(line));
        }
    }
    let body = body
        .replace("</h1><tr>", "</h1><table><tr>")
        .replace("</tr><h2>", "</tr></table><h2>");
    format!(
        "<!doctype html><html><head><meta charset='utf-8'><title>specd A/B</title><style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}td{{border:1px solid #ccc;padding:3px 8px}}</style></head><body>{body}<h2>Charts</h2>{}<br>{}<br>{}</body></html>",
        svg_bars("Speedup against plain decoding, by category", &cats, &speed, "x", Some(1.0)),
        svg_lines("Acceptance rate by draft position", &acc),
        svg_bars("Latency", &lat_labels, &lat, "", None),
    )
}

/// Write results.json, summary.md and report.html into `dir`.
pub fn write_outputs(r: &AbReport, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let files = vec![
        dir.join("results.json"),
        dir.join("summary.md"),
        dir.join("report.html"),
    ];
    std::fs::write(
        &files[0],
        serde_json::to_string_pretty(r).map_err(|e| SpecdError::InvalidRequest(e.to_string()))?,
    )?;
    std::fs::write(&files[1], markdown(r))?;
    std::fs::write(&files[2], html(r))?;
    Ok(files)
}

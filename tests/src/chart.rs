//! The status-quo benches' picture: memory over load / use / drop cycles
//! in one process, against the same cycles under berth, as an SVG for
//! docs/ (`models` for candle, `python_models` for PyTorch and JAX).

use std::fmt::Write;
use std::path::Path;

/// One line: the memory after each load-and-use and after each drop.
#[derive(Debug, Clone)]
pub struct Cycles {
    pub label: String,
    pub color: &'static str,
    /// MiB before the first load.
    pub before: f64,
    /// MiB after each cycle's load and use.
    pub loaded: Vec<f64>,
    /// MiB after each cycle's drop (or unload).
    pub dropped: Vec<f64>,
}

/// The colours the two sides take.
pub const IN_PROCESS: &str = "#c62828";
pub const BERTH: &str = "#1565c0";

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG of `lines` over their cycles: x is before, then load / drop of
/// cycle 1, 2, ...; y is MiB from 0. `note` may have several lines.
pub fn cycles_svg(title: &str, note: &str, lines: &[Cycles]) -> String {
    let notes: Vec<&str> = note.lines().collect();
    let (w, h, l, r, b) = (840.0, 350.0, 64.0, 220.0, 40.0);
    let t = 46.0 + 15.0 * notes.len().saturating_sub(1) as f64;
    let cycles = lines
        .iter()
        .map(|c| c.loaded.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let steps = 2 * cycles; // before, then load/drop pairs
    let top = lines
        .iter()
        .flat_map(|c| c.loaded.iter().chain(&c.dropped).chain([&c.before]))
        .fold(1.0f64, |m, v| m.max(*v))
        * 1.1;
    let x = |step: usize| l + step as f64 / steps as f64 * (w - l - r);
    let y = |mib: f64| t + (1.0 - mib / top) * (h - t - b);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="system-ui, -apple-system, 'Segoe UI', sans-serif" font-size="12">
<rect width="{w}" height="{h}" fill="#ffffff"/>
<text x="{l}" y="20" font-size="15" font-weight="600" fill="#1d2329">{}</text>
"##,
        escape(title),
    );
    for (i, line) in notes.iter().enumerate() {
        let _ = writeln!(
            svg,
            r##"<text x="{l}" y="{}" fill="#687684">{}</text>"##,
            36 + 15 * i,
            escape(line)
        );
    }
    for i in 0..=4 {
        let v = top / 1.1 * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{l}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e3e8ed"/><text x="{}" y="{:.1}" text-anchor="end" fill="#687684">{v:.0} MiB</text>"##,
            w - r,
            l - 6.0,
            y(v) + 4.0,
            y = y(v),
        );
    }
    let label_every = cycles.div_ceil(10).max(1);
    for c in (0..cycles).step_by(label_every) {
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#687684">{}</text>"##,
            x(2 * c + 1),
            h - b + 16.0,
            c + 1
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#687684">cycle (load and use, then drop or unload)</text>"##,
        (l + w - r) / 2.0,
        h - 6.0
    );
    for (i, line) in lines.iter().enumerate() {
        let mut points = vec![(0, line.before)];
        for (c, (loaded, dropped)) in line.loaded.iter().zip(&line.dropped).enumerate() {
            points.push((2 * c + 1, *loaded));
            points.push((2 * c + 2, *dropped));
        }
        let path: Vec<String> = points
            .iter()
            .map(|(s, v)| format!("{:.1},{:.1}", x(*s), y(*v)))
            .collect();
        let _ = writeln!(
            svg,
            r##"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"##,
            path.join(" "),
            line.color
        );
        for (s, v) in points.iter().filter(|(s, _)| s % 2 == 0) {
            let _ = writeln!(
                svg,
                r##"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"##,
                x(*s),
                y(*v),
                line.color
            );
        }
        let last = line.dropped.last().copied().unwrap_or(line.before);
        let ly = t + 14.0 + 34.0 * i as f64;
        let _ = writeln!(
            svg,
            r##"<rect x="{}" y="{:.1}" width="14" height="3" fill="{}"/><text x="{}" y="{:.1}" fill="#1d2329">{}</text><text x="{}" y="{:.1}" fill="#687684">after the last drop: {last:.0} MiB</text>"##,
            w - r + 12.0,
            ly - 4.0,
            line.color,
            w - r + 30.0,
            ly,
            escape(&line.label),
            w - r + 30.0,
            ly + 14.0,
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Writes the chart to `docs/NAME` of the repository and says so.
pub fn write_cycles_chart(name: &str, title: &str, note: &str, lines: &[Cycles]) {
    let path = crate::python::repo_root().join("docs").join(name);
    std::fs::write(&path, cycles_svg(title, note, lines)).expect("the chart is written");
    eprintln!("(chart written to {})", display(&path));
}

fn display(path: &Path) -> String {
    path.strip_prefix(crate::python::repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

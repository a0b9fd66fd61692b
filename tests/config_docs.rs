//! docs/configuration.md against the config types: every documented key
//! parses (the types refuse unknown keys), and every key the types
//! serialize is documented, so the page cannot drift from the code.

use std::collections::BTreeSet;
use std::path::Path;

use specd::config::Config;

/// (table path, key, example TOML value) of every row of every table in
/// the page, the table path without brackets (`engine`, `server.split`).
fn documented() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let mut rows = Vec::new();
    let mut table: Option<String> = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            table = Some(h.trim().trim_matches('`').replace(['[', ']'], ""));
            continue;
        }
        let Some(t) = &table else { continue };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | `key` | default | meaning |
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let key = cells[1].trim_matches('`').to_string();
        let default = cells[2];
        let example = default
            .split('`')
            .nth(1)
            .unwrap_or_else(|| panic!("{t}.{key}: the default column holds no `value`"));
        rows.push((t.clone(), key, example.to_string()));
    }
    rows
}

/// Every key path of `v` (`engine.max_draft`), descending into tables and
/// arrays of tables; a proposer's `options` are the plugin's own.
fn keys(prefix: &str, v: &serde_json::Value, out: &mut BTreeSet<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(path.clone());
                if path != "proposer.options" {
                    keys(&path, x, out);
                }
            }
        }
        serde_json::Value::Array(a) => {
            for x in a.iter().filter(|x| x.is_object()) {
                keys(prefix, x, out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_documented_key_parses_and_every_key_is_documented() {
    let rows = documented();
    assert!(rows.len() > 60, "too few rows read: {}", rows.len());
    // One TOML with every documented key set to its example value.
    let mut tables: Vec<(String, Vec<String>)> = Vec::new();
    for (t, k, v) in &rows {
        match tables.iter_mut().find(|(name, _)| name == t) {
            Some((_, lines)) => lines.push(format!("{k} = {v}")),
            None => tables.push((t.clone(), vec![format!("{k} = {v}")])),
        }
    }
    let arrays = ["proposer", "server.split", "route", "ab.arm"];
    let mut toml_text = String::new();
    for (t, lines) in &tables {
        // A key whose value is a table or array of tables documented
        // under its own heading is set there.
        let lines: Vec<&String> = lines
            .iter()
            .filter(|l| {
                let k = l.split(" = ").next().unwrap();
                !tables.iter().any(|(n, _)| *n == format!("{t}.{k}"))
            })
            .collect();
        let head = if arrays.contains(&t.as_str()) {
            format!("[[{t}]]")
        } else {
            format!("[{t}]")
        };
        toml_text.push_str(&format!(
            "{head}\n{}\n\n",
            lines
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    let cfg: Config = toml::from_str(&toml_text)
        .unwrap_or_else(|e| panic!("the documented keys do not parse: {e}\n{toml_text}"));
    // Every key the types serialize (the documented config, and the
    // defaults) is documented.
    let mut have = BTreeSet::new();
    keys("", &serde_json::to_value(&cfg).unwrap(), &mut have);
    keys(
        "",
        &serde_json::to_value(Config::default()).unwrap(),
        &mut have,
    );
    let listed: BTreeSet<String> = rows.iter().map(|(t, k, _)| format!("{t}.{k}")).collect();
    let tables_named: BTreeSet<&str> = tables.iter().map(|(t, _)| t.as_str()).collect();
    let missing: Vec<&String> = have
        .iter()
        .filter(|k| !listed.contains(*k) && !tables_named.contains(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "keys the config types have that docs/configuration.md does not list: {missing:?}"
    );
    // The control: a key the types do not have is refused, so the parse
    // above really checked the documented names.
    let bad = toml_text.replacen("[engine]\n", "[engine]\nmax_drafts = 4\n", 1);
    assert!(toml::from_str::<Config>(&bad).is_err());
}

/// The documented defaults are the defaults: an empty config parses to
/// the values the page lists (for keys with a default).
#[test]
fn documented_defaults_are_the_defaults() {
    let rows = documented();
    let dflt = serde_json::to_value(Config::default()).unwrap();
    let ab = serde_json::to_value(
        toml::from_str::<Config>("[ab]\n")
            .unwrap()
            .ab
            .expect("[ab]"),
    )
    .unwrap();
    let mut checked = 0;
    for (t, k, v) in &rows {
        let cell_has_default =
            !v.is_empty() && documented_default_cell(t, k).is_some_and(|c| !c.starts_with("none"));
        if !cell_has_default || t.contains("arm") || t == "proposer" || t.ends_with("split") {
            continue;
        }
        let actual = if let Some(rest) = t.strip_prefix("ab") {
            let mut x = &ab;
            for part in rest.split('.').filter(|p| !p.is_empty()) {
                x = &x[part];
            }
            x[k.as_str()].clone()
        } else {
            let mut x = &dflt;
            for part in t.split('.') {
                x = &x[part];
            }
            x[k.as_str()].clone()
        };
        let want: toml::Value =
            toml::from_str::<toml::Table>(&format!("x = {v}")).unwrap()["x"].clone();
        let want = serde_json::to_value(want).unwrap();
        let same = match (&want, &actual) {
            (serde_json::Value::Number(a), serde_json::Value::Number(b)) => {
                (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-6
            }
            (serde_json::Value::Object(a), _) if a.is_empty() => actual.is_object(),
            // An empty list the types skip when serializing.
            (serde_json::Value::Array(a), serde_json::Value::Null) => a.is_empty(),
            _ => want == actual,
        };
        assert!(same, "{t}.{k}: documented default {v}, actual {actual}");
        checked += 1;
    }
    assert!(checked > 40, "too few defaults checked: {checked}");
}

/// The default column of `t`.`k`, as written.
fn documented_default_cell(t: &str, k: &str) -> Option<String> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    let mut table = String::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            table = h.trim().trim_matches('`').replace(['[', ']'], "");
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if table == t && cells.len() >= 4 && cells[1] == format!("`{k}`") {
            return Some(cells[2].to_string());
        }
    }
    None
}

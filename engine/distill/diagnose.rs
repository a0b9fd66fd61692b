//! `specd distill diagnose`: why a trained head is (not) accepted.
//!
//! Two views of one head over the same texts (the samples and target
//! features a `distill eagle` / `distill mtp` run cached in its `train/`):
//! - the training graph (`eagle::Net`), TTT-unrolled as in training: per
//!   step the acceptance@1, the acceptance conditional on every earlier
//!   step being right (and the text following the target's greedy token,
//!   so the chain is one the target would have kept), how often the step
//!   repeats the previous step's argmax, `||y - g|| / ||g||` and the
//!   attention weight a row gives its own key;
//! - the inference path the plugin runs (`model::eagle::Head`, EAGLE-3):
//!   from every response position a fixed greedy chain of depth 3, with
//!   the head in f32 or in Q8_0, with or without the catch-up window (the
//!   plugin keeps only the newest `window` positions of a long prompt).
//!
//! Invariant: the split into training and validation samples is the
//! trainer's (same seeded hash), so "val" means texts the head never saw.

use std::path::Path;
use std::sync::Arc;

use super::eagle::{embedding_table, Corpus, EagleConfig, Net};
use super::train::{extract_features, plan_batches};
use super::{training_data, Sample};
use crate::error::{Result, SpecdError};
use crate::model::eagle::{Head, KvStore, Src, Variant};
use crate::tokenizer::Tokenizer;

/// What `diagnose` measures and on how much.
#[derive(Debug, Clone)]
pub struct DiagnoseConfig {
    /// TTT steps of the training graph.
    pub ttt: usize,
    /// Training samples measured (the validation split is measured whole).
    pub train_samples: usize,
    /// Samples of each split run through the inference path (0: none).
    pub chain_samples: usize,
    /// The plugin's catch-up window (its `window` option's default).
    pub window: usize,
    /// The first positions the plugin's window keeps.
    pub sink: usize,
    /// The trainer's settings the data and split came from.
    pub train: EagleConfig,
}

impl Default for DiagnoseConfig {
    fn default() -> Self {
        Self {
            ttt: 4,
            train_samples: 240,
            chain_samples: 80,
            window: 256,
            sink: 4,
            train: EagleConfig::default(),
        }
    }
}

/// One TTT step of the training graph over one split.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepRow {
    pub step: usize,
    pub rows: usize,
    pub acc: f64,
    /// Acceptance given every earlier step right (and the text greedy).
    pub cond_acc: f64,
    pub cond_rows: usize,
    /// Argmax equal to the previous step's.
    pub repeat: f64,
    /// Mean `||y - g|| / ||g||`.
    pub rel_update: f64,
    /// Mean attention weight on the row's own key.
    pub own_attention: f64,
}

/// A depth-3 greedy chain through the inference path.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ChainRow {
    pub split: String,
    pub quantized: bool,
    pub window: usize,
    pub sink: usize,
    pub roots: usize,
    /// Per depth: acceptance given the earlier depths accepted.
    pub cond_acc: Vec<f64>,
    /// Per depth (from 2): drafted token equal to the previous depth's.
    pub repeat: Vec<f64>,
    /// Mean accepted draft tokens per chain (over roots).
    pub mean_accepted: f64,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    pub mtp: bool,
    pub train: Vec<StepRow>,
    pub val: Vec<StepRow>,
    pub chains: Vec<ChainRow>,
}

fn serr(e: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill diagnose: {e}"))
}

/// Measure the head in `head_dir` on the samples and features cached in
/// `data_dir` (a trainer's `train/`).
pub fn diagnose(
    target_path: &Path,
    head_dir: &Path,
    data_dir: &Path,
    cfg: &DiagnoseConfig,
    threads: usize,
) -> Result<Report> {
    let target = Arc::new(crate::model::load_model(target_path, threads)?);
    let tok = Arc::new(Tokenizer::for_model(target_path)?);
    let tc = target.config.clone();
    // The data settings of the run that made `data_dir` (its state.json),
    // so its cached samples are the ones read (prompt ids are not saved).
    let saved: Option<EagleConfig> = std::fs::read_to_string(data_dir.join("state.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<super::eagle::EagleState>(&t).ok())
        .map(|st| EagleConfig {
            prompt_ids: cfg.train.prompt_ids.clone(),
            ..st.config
        });
    let tcfg = saved.as_ref().unwrap_or(&cfg.train);
    let data_cfg = tcfg.data_config();
    if !data_dir.join("samples.json").exists() {
        return Err(serr(format!(
            "{}: no samples.json (give a trainer's train/ directory)",
            data_dir.display()
        )));
    }
    let mut samples = training_data(&target, &tok, &data_cfg, data_dir)?;
    for s in &mut samples {
        s.tokens.truncate(tcfg.max_len);
        s.prompt_len = s.prompt_len.min(s.tokens.len());
    }
    let net = Net::from_head(head_dir, &target, tcfg.max_len + cfg.ttt + 2)?;
    let mtp = net.is_mtp();
    // The layers the head reads, as its config names them (a head trained
    // with `--feature-layers` reads others than EAGLE-3's).
    let layers = if mtp {
        vec![tc.layers]
    } else {
        Head::load_with(head_dir, tc.hidden, tc.vocab_size, tc.layers, false)
            .map_err(serr)?
            .cfg
            .feature_layers
    };
    let mut recorded = layers.clone();
    if !recorded.contains(&tc.layers) {
        recorded.push(tc.layers);
    }
    let features = extract_features(
        &target,
        &samples,
        &recorded,
        &data_dir.join("features.safetensors"),
    )?;
    // The head's draft vocabulary, from its d2t.
    let tf = crate::model::tensor_file::TensorFile::read(&head_dir.join("model.safetensors"))
        .map_err(serr)?;
    let d2t = tf.i64("d2t").map_err(serr)?;
    let mut t2d = vec![-1i64; tc.vocab_size];
    for (i, &d) in d2t.iter().enumerate() {
        let t = i as i64 + d;
        if let Some(x) = t2d.get_mut(t as usize) {
            *x = i as i64;
        }
    }
    let (train_idx, val_idx) = super::split(samples.len(), tcfg.seed, tcfg.val_fraction);
    // A spread-out subset of the training split.
    let stride = (train_idx.len() / cfg.train_samples.max(1)).max(1);
    let train_sub: Vec<usize> = train_idx.iter().step_by(stride).copied().collect();
    let corpus = Corpus {
        samples: &samples,
        f: &features,
        feature_layers: layers.clone(),
        fin: tc.layers,
        t2d: t2d.clone(),
        h: tc.hidden,
        nl: layers.len(),
        drop_oov: false,
    };
    let graph = |idx: &[usize]| -> Result<Vec<StepRow>> {
        let mut acc = vec![Acc::default(); cfg.ttt];
        for b in plan_batches(&samples, idx, tcfg.batch_tokens, tcfg.max_len, 1) {
            let batch = corpus.batch(&b, cfg.ttt, tcfg.max_len)?;
            let (pred, probe) = net.probe(&batch)?;
            for r in 0..batch.b * batch.t {
                // Chains start at response positions (step 0 in the loss).
                let mut chain_ok = batch.steps[0].mask[r] > 0.0;
                for k in 0..cfg.ttt {
                    let sd = &batch.steps[k];
                    if sd.mask[r] <= 0.0 {
                        chain_ok = false;
                        continue;
                    }
                    let a = &mut acc[k];
                    let hit = i64::from(pred[k][r]) == sd.argmax[r];
                    a.rows += 1;
                    a.hits += usize::from(hit);
                    a.rel += f64::from(probe[k].rel[r]);
                    a.own += f64::from(probe[k].own_att[r]);
                    if k > 0 {
                        a.repeats += usize::from(pred[k][r] == pred[k - 1][r]);
                    }
                    if chain_ok {
                        a.cond_rows += 1;
                        a.cond_hits += usize::from(hit);
                    }
                    // The next step is fed the text's token: the chain
                    // stays one the target keeps only if that token is
                    // the target's greedy one and the head drafted it.
                    let fed_next = batch.steps.get(k + 1).map(|n| n.ids[r]);
                    let greedy_text = fed_next.is_some_and(|id| t2d[id as usize] == sd.argmax[r]);
                    chain_ok = chain_ok && hit && greedy_text;
                }
            }
        }
        Ok(acc.iter().enumerate().map(|(k, a)| a.row(k)).collect())
    };
    let mut report = Report {
        mtp,
        train: graph(&train_sub)?,
        val: graph(&val_idx)?,
        chains: Vec::new(),
    };
    drop(net);
    if cfg.chain_samples > 0 && !mtp {
        let emb = embedding_table(&target);
        for quantized in [false, true] {
            let head = Head::load_with(head_dir, tc.hidden, tc.vocab_size, tc.layers, quantized)
                .map_err(serr)?;
            if head.cfg.variant != Variant::Eagle3 {
                break;
            }
            // Both splits without a window (the training graph's view);
            // the validation split with the plugin's window, without and
            // with its first positions kept (f32 only: quantization is
            // measured without a window).
            let mut runs = vec![("val", 0, 0)];
            if !quantized {
                runs.insert(0, ("train", 0, 0));
                runs.push(("val", cfg.window, 0));
                runs.push(("val", cfg.window, cfg.sink));
            }
            for (split, window, sink) in runs {
                let idx = if split == "train" {
                    &train_sub
                } else {
                    &val_idx
                };
                let take: Vec<usize> = idx.iter().take(cfg.chain_samples).copied().collect();
                let mut row = chains(&head, &emb, &samples, &corpus, &take, (window, sink), &t2d)?;
                row.split = split.into();
                row.quantized = quantized;
                report.chains.push(row);
            }
        }
    }
    Ok(report)
}

#[derive(Debug, Clone, Default)]
struct Acc {
    rows: usize,
    hits: usize,
    cond_rows: usize,
    cond_hits: usize,
    repeats: usize,
    rel: f64,
    own: f64,
}

impl Acc {
    fn row(&self, step: usize) -> StepRow {
        let n = self.rows.max(1) as f64;
        StepRow {
            step,
            rows: self.rows,
            acc: self.hits as f64 / n,
            cond_acc: self.cond_hits as f64 / self.cond_rows.max(1) as f64,
            cond_rows: self.cond_rows,
            repeat: if step == 0 {
                f64::NAN
            } else {
                self.repeats as f64 / n
            },
            rel_update: self.rel / n,
            own_attention: self.own / n,
        }
    }
}

const DEPTH: usize = 3;

/// Greedy chains of depth 3 from every response position of `idx`'s
/// samples, as the plugin drafts them: the head's cache holds the pairs
/// (features of p', token p'+1) of positions `w0..=p` (`w0`: where the
/// plugin's first catch-up window starts; the first `sink` positions are
/// kept before it), the root is position p's pair,
/// and each depth feeds the previous depth's output and drafted token.
fn chains(
    head: &Head,
    emb: &[f32],
    samples: &[Sample],
    corpus: &Corpus<'_>,
    idx: &[usize],
    (window, sink): (usize, usize),
    t2d: &[i64],
) -> Result<ChainRow> {
    let h = head.cfg.hidden;
    let nl = corpus.nl;
    let mut cond = [(0usize, 0usize); DEPTH];
    let mut repeats = [0usize; DEPTH];
    let (mut roots, mut accepted) = (0usize, 0usize);
    let embed = |ids: &[u32]| -> Vec<f32> {
        let mut e = Vec::with_capacity(ids.len() * h);
        for &t in ids {
            e.extend_from_slice(&emb[t as usize * h..(t as usize + 1) * h]);
        }
        e
    };
    for &si in idx {
        let s = &samples[si];
        let (len, plen) = (s.tokens.len(), s.prompt_len);
        if len < 3 {
            continue;
        }
        let o = corpus.f.offsets[si];
        let argmax = |q: usize| t2d[corpus.f.argmax[o + q] as usize];
        let n = len - 1;
        let mut feats = vec![0f32; n * nl * h];
        let mut src = Vec::with_capacity(n * h);
        for (li, &l) in corpus.feature_layers.iter().enumerate() {
            src.clear();
            corpus.f.extend(l, o, n, &mut src)?;
            for r in 0..n {
                feats[(r * nl + li) * h..(r * nl + li + 1) * h]
                    .copy_from_slice(&src[r * h..(r + 1) * h]);
            }
        }
        let g = head.fuse(&feats, n);
        let e = embed(&s.tokens[1..len]);
        let pos: Vec<usize> = (0..n).collect();
        let kv = head.kv_rows(&g, &e, &pos);
        let w0 = if window > 0 {
            plen.saturating_sub(window + 1)
        } else {
            0
        };
        // Roots: response positions whose first draft has a target token.
        let ps: Vec<usize> = (plen.saturating_sub(2)..n)
            .filter(|&p| p + 1 < len)
            .collect();
        if ps.is_empty() {
            continue;
        }
        let rows = ps.len();
        let mut gin: Vec<f32> = ps
            .iter()
            .flat_map(|&p| g[p * h..(p + 1) * h].iter().copied())
            .collect();
        let mut ein: Vec<f32> = ps
            .iter()
            .flat_map(|&p| e[p * h..(p + 1) * h].iter().copied())
            .collect();
        let mut ok = vec![true; rows];
        let mut prev: Vec<i64> = vec![-2; rows];
        let mut own_prev: Option<KvStore> = None;
        for d in 0..DEPTH {
            let posd: Vec<usize> = ps.iter().map(|&p| p + d).collect();
            let sees: Vec<Vec<Src>> = ps
                .iter()
                .enumerate()
                .map(|(r, &p)| {
                    let w = w0.min(p);
                    let mut v = vec![
                        Src::Range {
                            store: 0,
                            start: 0,
                            end: sink.min(w),
                        },
                        Src::Range {
                            store: 0,
                            start: w,
                            end: if d == 0 { p } else { p + 1 },
                        },
                    ];
                    if d == 2 {
                        v.push(Src::Row { store: 1, row: r });
                    }
                    v
                })
                .collect();
            let stores: Vec<&KvStore> = match &own_prev {
                Some(k) if d == 2 => vec![&kv, k],
                _ => vec![&kv],
            };
            let (y, own) = head.step(&stores, &gin, &ein, &posd, &sees);
            let logits = head.logits(&y, rows).unwrap_or_default();
            let dv = logits.len() / rows;
            let mut next_ids = Vec::with_capacity(rows);
            for (r, &p) in ps.iter().enumerate() {
                let pred = crate::sampler::argmax(&logits[r * dv..(r + 1) * dv]) as i64;
                let q = p + 1 + d;
                if ok[r] && q < len {
                    let hit = pred == argmax(q);
                    cond[d].0 += 1;
                    cond[d].1 += usize::from(hit);
                    if d > 0 {
                        repeats[d] += usize::from(pred == prev[r]);
                    }
                    accepted += usize::from(hit);
                    // The chain goes on only where the text is the target's
                    // greedy continuation (its features are then right).
                    ok[r] = hit && q + 1 < len && t2d[s.tokens[q + 1] as usize] == pred;
                } else {
                    ok[r] = false;
                }
                prev[r] = pred;
                let tid = head.d2t.get(pred as usize).copied().unwrap_or(0);
                next_ids.push(tid);
            }
            if d == 0 {
                roots += rows;
            }
            gin = y;
            ein = embed(&next_ids);
            own_prev = Some(own);
        }
    }
    Ok(ChainRow {
        split: String::new(),
        quantized: false,
        window,
        sink,
        roots,
        cond_acc: cond
            .iter()
            .map(|&(n, h)| h as f64 / n.max(1) as f64)
            .collect(),
        repeat: (1..DEPTH)
            .map(|d| repeats[d] as f64 / cond[d].0.max(1) as f64)
            .collect(),
        mean_accepted: accepted as f64 / roots.max(1) as f64,
    })
}

impl Report {
    /// Markdown tables.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        for (name, rows) in [("train", &self.train), ("val", &self.val)] {
            s += &format!(
                "\n### Training graph, {name} split ({})\n\n| TTT step | rows | acc@1 | acc given earlier right | repeats previous | ‖y−g‖/‖g‖ | own-key attention |\n|---|---|---|---|---|---|---|\n",
                if self.mtp { "MTP" } else { "EAGLE-3" }
            );
            for r in rows.iter() {
                s += &format!(
                    "| {} | {} | {:.3} | {:.3} ({}) | {} | {:.3} | {:.3} |\n",
                    r.step,
                    r.rows,
                    r.acc,
                    r.cond_acc,
                    r.cond_rows,
                    if r.repeat.is_nan() {
                        "-".into()
                    } else {
                        format!("{:.3}", r.repeat)
                    },
                    r.rel_update,
                    r.own_attention
                );
            }
        }
        if !self.chains.is_empty() {
            s += "\n### Inference path (the plugin's head), greedy chain of depth 3\n\n| split | weights | window | roots | depth 1 | depth 2 given 1 | depth 3 given 1-2 | repeats (d2, d3) | accepted per chain |\n|---|---|---|---|---|---|---|---|---|\n";
            for c in &self.chains {
                s += &format!(
                    "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3}, {:.3} | {:.3} |\n",
                    c.split,
                    if c.quantized { "Q8_0" } else { "f32" },
                    match (c.window, c.sink) {
                        (0, _) => "all".to_string(),
                        (w, 0) => w.to_string(),
                        (w, k) => format!("{w} + first {k}"),
                    },
                    c.roots,
                    c.cond_acc[0],
                    c.cond_acc[1],
                    c.cond_acc[2],
                    c.repeat[0],
                    c.repeat[1],
                    c.mean_accepted
                );
            }
        }
        s
    }
}

//! The trainers' shared scaffolding (`distill eagle`, `medusa`, `draft`
//! and `diagnose`): the target's recorded features, the draft vocabulary,
//! batches, the optimiser and its schedule, checkpoints that resume
//! exactly, and the step loop's epochs and progress.
//!
//! Invariants:
//! - A checkpoint holds every parameter and both AdamW moments under
//!   `adam_m.` / `adam_v.`, with the run's state beside it; a resumed run
//!   continues the same step sequence (epoch `e` is planned with seed
//!   `seed + e`, whatever step the run resumed at).
//! - A checkpoint whose tensor shapes do not match the configuration is
//!   refused by name, never silently re-initialised.
//! - Features are trained on as the cache holds them (f16), so a resumed
//!   run sees the same numbers as the run that wrote them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor, Var};

use super::{training_data, DataConfig, Sample};
use crate::error::{Result, SpecdError};
use crate::model::tensor_file::{self, Dtype, RowFile, TensorData, TensorFile};
use crate::model::{ForwardInput, Logits, Model};
use crate::sampler::Rng;
use crate::tokenizer::Tokenizer;

pub(super) fn cerr(e: candle_core::Error) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill: {e}"))
}

fn serr(e: String) -> SpecdError {
    SpecdError::InvalidRequest(format!("distill: {e}"))
}

/// Cut every sample to `max_len` tokens (its prompt with it).
pub(super) fn truncate(samples: &mut [Sample], max_len: usize) {
    for s in samples {
        s.tokens.truncate(max_len);
        s.prompt_len = s.prompt_len.min(s.tokens.len());
    }
}

/// Recorded target hidden states of every sample, row per token, read
/// from their cache file a range of rows at a time: a corpus's states
/// (rows x hidden x recorded layers, f16) are far larger than memory, so
/// batches read what they need and the page cache keeps what fits.
pub(super) struct Features {
    file: RowFile,
    /// Hidden size (values per row).
    pub(super) h: usize,
    /// Target argmax per row (the token the target predicts next).
    pub(super) argmax: Vec<u32>,
    /// First row of each sample.
    pub(super) offsets: Vec<usize>,
}

impl Features {
    /// Rows `r0..r0 + dst.len() / h` of the recorded state `l` (a hidden
    /// index; the final-normed state under the target's layer count).
    pub(super) fn rows(&self, l: usize, r0: usize, dst: &mut [f32]) -> Result<()> {
        self.file
            .read_rows(&format!("layer.{l}"), r0, dst)
            .map_err(serr)
    }

    /// [`Features::rows`] appended to `out`.
    pub(super) fn extend(&self, l: usize, r0: usize, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let at = out.len();
        out.resize(at + n * self.h, 0.0);
        self.rows(l, r0, &mut out[at..])
    }

    /// Every row of the recorded state `l` were recorded.
    pub(super) fn has(&self, l: usize) -> bool {
        self.file
            .shape(&format!("layer.{l}"))
            .is_some_and(|s| s == [self.argmax.len(), self.h])
    }
}

/// Run every sample through the target once, recording the hidden states
/// of `layers` (cached at `path`, written as they come; a cache holding
/// them is reused).
pub(super) fn extract_features(
    target: &Model,
    samples: &[Sample],
    layers: &[usize],
    path: &Path,
) -> Result<Features> {
    let h = target.config.hidden;
    let total: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let mut offsets = Vec::with_capacity(samples.len());
    let mut acc = 0;
    for s in samples {
        offsets.push(acc);
        acc += s.tokens.len();
    }
    // Which samples the states are of: a file made for other samples of
    // the same total length (another `--corpus-shards`, say) is not
    // reused. A file without this key (made before it existed, or linked
    // from another run without it) is reused on the length alone.
    let key_path = samples_key_path(path);
    let key = samples_key(samples);
    let same_samples = std::fs::read_to_string(&key_path).map_or(true, |k| k.trim() == key);
    let reusable = if same_samples {
        RowFile::open(path).ok()
    } else {
        eprintln!(
            "specd distill: {} holds the states of other samples: recording anew",
            path.display()
        );
        None
    };
    if let Some(file) = reusable {
        if file.shape("argmax") == Some(&[total][..]) {
            let argmax = file
                .read_i64("argmax")
                .map_err(serr)?
                .into_iter()
                .map(|x| x as u32)
                .collect();
            let f = Features {
                file,
                h,
                argmax,
                offsets: offsets.clone(),
            };
            if layers.iter().all(|&l| f.has(l)) {
                eprintln!(
                    "specd distill: reusing target features from {}",
                    path.display()
                );
                return Ok(f);
            }
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut layers = layers.to_vec();
    layers.sort_unstable();
    layers.dedup();
    let names: Vec<String> = layers.iter().map(|l| format!("layer.{l}")).collect();
    let mut spec: Vec<(&str, Dtype, Vec<usize>)> = vec![("argmax", Dtype::I64, vec![total])];
    spec.extend(
        names
            .iter()
            .map(|n| (n.as_str(), Dtype::F16, vec![total, h])),
    );
    let file = RowFile::create(path, &spec).map_err(serr)?;
    let mut argmax = vec![0u32; total];
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} tokens through the target (features)  {elapsed} elapsed, ~{eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let vocab = target.config.vocab_size;
    let mut i = 0;
    while i < samples.len() {
        // Groups of about 512 tokens: big matmuls, bounded logits memory.
        let mut j = i;
        let mut n = 0;
        while j < samples.len() && (j == i || n + samples[j].tokens.len() <= 512) {
            n += samples[j].tokens.len();
            j += 1;
        }
        let mut caches: Vec<_> = (i..j).map(|_| target.new_cache()).collect();
        let mut inputs: Vec<ForwardInput<'_>> = caches
            .iter_mut()
            .zip(&samples[i..j])
            .map(|(cache, s)| ForwardInput {
                cache,
                tokens: &s.tokens,
                logits: Logits::All,
                tree: None,
            })
            .collect();
        let outs = target.forward(&mut inputs, &layers)?;
        for (k, out) in outs.iter().enumerate() {
            let s = i + k;
            let (o, len) = (offsets[s], samples[s].tokens.len());
            for (l, rows) in &out.hidden {
                if rows.len() != len * h {
                    return Err(serr(format!(
                        "layer {l}: {} values recorded for {len} tokens of width {h}",
                        rows.len()
                    )));
                }
                file.write_f16_rows(&format!("layer.{l}"), o, rows)
                    .map_err(serr)?;
            }
            for r in 0..len {
                let row = &out.logits[r * vocab..(r + 1) * vocab];
                argmax[o + r] = crate::sampler::argmax(row);
            }
        }
        bar.inc(n as u64);
        i = j;
    }
    bar.finish_and_clear();
    let am: Vec<i64> = argmax.iter().map(|&x| i64::from(x)).collect();
    file.write_i64("argmax", &am).map_err(serr)?;
    let file = file.finish().map_err(serr)?;
    std::fs::write(&key_path, &key)?;
    // Train on what the cache holds (f16), so a resumed run sees the same.
    Ok(Features {
        file,
        h,
        argmax,
        offsets,
    })
}

/// Where `extract_features` keeps the key of the samples a features file
/// holds the states of: beside it, `<file>.samples`.
fn samples_key_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".samples");
    p.into()
}

/// A 64-bit FNV-1a hash of the samples' tokens and lengths, in hex.
fn samples_key(samples: &[Sample]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for s in samples {
        eat(s.tokens.len() as u64);
        for &t in &s.tokens {
            eat(u64::from(t));
        }
    }
    format!("{h:016x}")
}

/// The `n` most frequent response tokens (EOS ids always in), ascending.
pub(super) fn choose_draft_vocab(
    samples: &[Sample],
    n: usize,
    vocab: usize,
    eos: &[u32],
) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for s in samples {
        for &t in &s.tokens[s.prompt_len..] {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1;
            }
        }
    }
    for &e in eos {
        if let Some(c) = counts.get_mut(e as usize) {
            *c = u64::MAX;
        }
    }
    let mut ids: Vec<u32> = (0..vocab as u32).collect();
    ids.sort_by(|a, b| counts[*b as usize].cmp(&counts[*a as usize]).then(a.cmp(b)));
    ids.truncate(n.min(vocab));
    ids.sort_unstable();
    ids
}

/// A draft vocabulary: the target ids it keeps (ascending), each target
/// id's draft index (`-1` outside it), and the share of response tokens
/// it covers.
pub(super) struct DraftVocab {
    pub(super) ids: Vec<u32>,
    pub(super) t2d: Vec<i64>,
    pub(super) coverage: f64,
}

/// [`choose_draft_vocab`] with its index and coverage, reported.
pub(super) fn draft_vocab(samples: &[Sample], n: usize, vocab: usize, eos: &[u32]) -> DraftVocab {
    draft_vocab_of(samples, choose_draft_vocab(samples, n, vocab, eos), vocab)
}

/// The draft vocabulary `ids` (chosen already, e.g. a head's own), with
/// its map from target ids and its coverage of `samples`' responses.
pub(super) fn draft_vocab_of(samples: &[Sample], ids: Vec<u32>, vocab: usize) -> DraftVocab {
    let mut t2d = vec![-1i64; vocab];
    for (i, &t) in ids.iter().enumerate() {
        t2d[t as usize] = i as i64;
    }
    let (mut covered, mut all) = (0usize, 0usize);
    for s in samples {
        for &t in &s.tokens[s.prompt_len..] {
            all += 1;
            covered += usize::from(t2d[t as usize] >= 0);
        }
    }
    let coverage = covered as f64 / all.max(1) as f64;
    eprintln!(
        "specd distill: draft vocabulary of {} tokens covers {:.1}% of {all} response tokens",
        ids.len(),
        coverage * 100.0
    );
    DraftVocab { ids, t2d, coverage }
}

/// Batches of sample indices: similar lengths together, `batch_tokens`
/// padded tokens at most, in a seeded random order.
pub(super) fn plan_batches(
    samples: &[Sample],
    idx: &[usize],
    batch_tokens: usize,
    max_len: usize,
    seed: u64,
) -> Vec<Vec<usize>> {
    let mut sorted = idx.to_vec();
    sorted.sort_by_key(|&i| (samples[i].tokens.len(), i));
    let mut out = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    for i in sorted {
        let len = samples[i].tokens.len().min(max_len);
        if !cur.is_empty() && (cur.len() + 1) * len > batch_tokens {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    let mut rng = Rng::new(seed ^ 0xEA61E);
    for i in (1..out.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        out.swap(i, j);
    }
    out
}

/// Linear warm-up over `warmup` steps (at most a tenth of the run), then
/// cosine decay to 5% of `lr`.
pub(super) fn cosine_lr(lr: f64, warmup: usize, step: usize, steps: usize) -> f64 {
    let warm = warmup.min(steps / 10).max(1);
    if step < warm {
        lr * (step + 1) as f64 / warm as f64
    } else {
        let p = (step - warm) as f64 / (steps - warm).max(1) as f64;
        lr * (0.05 + 0.95 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
    }
}

/// AdamW whose moments are saved with the checkpoint.
pub(super) struct AdamW {
    pub(super) m: HashMap<String, Tensor>,
    pub(super) v: HashMap<String, Tensor>,
    pub(super) t: usize,
}

impl AdamW {
    const B1: f64 = 0.9;
    const B2: f64 = 0.95;
    const WD: f64 = 0.0;

    pub(super) fn new() -> Self {
        Self {
            m: HashMap::new(),
            v: HashMap::new(),
            t: 0,
        }
    }

    /// One update of the parameters `p` from `grads`, their global norm
    /// clipped to `clip`; returns the norm before clipping.
    pub(super) fn step<'a>(
        &mut self,
        p: impl Iterator<Item = (&'a str, &'a Var)> + Clone,
        grads: &candle_core::backprop::GradStore,
        lr: f64,
        clip: f64,
    ) -> candle_core::Result<f64> {
        self.t += 1;
        let mut sq = 0f64;
        for (_, var) in p.clone() {
            if let Some(g) = grads.get(var.as_tensor()) {
                sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
            }
        }
        let norm = sq.sqrt();
        let s = if norm > clip { clip / norm } else { 1.0 };
        let (b1t, b2t) = (
            1.0 - Self::B1.powi(self.t as i32),
            1.0 - Self::B2.powi(self.t as i32),
        );
        for (name, var) in p {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = (g * s)?;
            let m = self.m.get(name).cloned().unwrap_or(g.zeros_like()?);
            let v = self.v.get(name).cloned().unwrap_or(g.zeros_like()?);
            let m = ((m * Self::B1)? + (&g * (1.0 - Self::B1))?)?;
            let v = ((v * Self::B2)? + (g.sqr()? * (1.0 - Self::B2))?)?;
            let upd = ((&m / b1t)? / ((&v / b2t)?.sqrt()? + 1e-8)?)?;
            let w = var.as_tensor();
            let next = ((w * (1.0 - lr * Self::WD))? - (upd * lr)?)?;
            var.set(&next)?;
            self.m.insert(name.to_string(), m);
            self.v.insert(name.to_string(), v);
        }
        Ok(norm)
    }
}

/// A tensor's values as f32, flattened.
pub(super) fn tensor_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(cerr)
}

/// Write the head in the EAGLE-3 layout (F16 weights, `d2t`, `t2d`).
/// A run's checkpoint: `<train>/checkpoint.safetensors` (parameters and
/// AdamW moments) and `<train>/state.json` (the trainer's state).
pub(super) struct Checkpoint {
    pub(super) weights: PathBuf,
    pub(super) state: PathBuf,
    dir: PathBuf,
}

impl Checkpoint {
    pub(super) fn new(train_dir: &Path) -> Self {
        Self {
            weights: train_dir.join("checkpoint.safetensors"),
            state: train_dir.join("state.json"),
            dir: train_dir.to_path_buf(),
        }
    }

    /// The state and tensors of an interrupted run, if both are there.
    pub(super) fn resume<S: serde::de::DeserializeOwned>(&self) -> Result<Option<(S, TensorFile)>> {
        match (
            std::fs::read_to_string(&self.state),
            TensorFile::read(&self.weights),
        ) {
            (Ok(s), Ok(f)) => Ok(Some((
                serde_json::from_str(&s)
                    .map_err(|e| serr(format!("{}: {e}", self.state.display())))?,
                f,
            ))),
            _ => Ok(None),
        }
    }

    /// Parameter `name`'s saved values, its AdamW moments restored into
    /// `opt`; a shape other than `shape` is refused by name.
    pub(super) fn restore(
        &self,
        f: &TensorFile,
        name: &str,
        shape: &[usize],
        opt: &mut AdamW,
    ) -> Result<Vec<f32>> {
        if f.shape(name) != Some(shape) {
            return Err(serr(format!(
                "{}: tensor `{name}` does not match this configuration (expected shape {shape:?}); delete {} to start over",
                self.weights.display(),
                self.dir.display()
            )));
        }
        for (map, pre) in [(&mut opt.m, "adam_m."), (&mut opt.v, "adam_v.")] {
            let v = f.f32(&format!("{pre}{name}")).map_err(serr)?;
            map.insert(
                name.to_string(),
                Tensor::from_vec(v, shape, &candle_core::Device::Cpu).map_err(cerr)?,
            );
        }
        f.f32(name).map_err(serr)
    }

    /// Write every parameter (`w` gives its tensor) with its moments, then
    /// the state.
    pub(super) fn save<'a, N: AsRef<str>, S: serde::Serialize>(
        &self,
        shapes: &[(N, Vec<usize>)],
        w: impl Fn(&str) -> &'a Tensor,
        opt: &AdamW,
        state: &S,
    ) -> Result<()> {
        let mut t = Vec::new();
        for (name, shape) in shapes {
            let name = name.as_ref();
            t.push((
                name.to_string(),
                shape.clone(),
                TensorData::F32(tensor_vec(w(name))?),
            ));
            for (map, pre) in [(&opt.m, "adam_m."), (&opt.v, "adam_v.")] {
                let v = match map.get(name) {
                    Some(x) => tensor_vec(x)?,
                    None => vec![0.0; shape.iter().product()],
                };
                t.push((format!("{pre}{name}"), shape.clone(), TensorData::F32(v)));
            }
        }
        tensor_file::write(&self.weights, &t).map_err(serr)?;
        std::fs::write(
            &self.state,
            serde_json::to_string_pretty(state).unwrap_or_default(),
        )?;
        Ok(())
    }
}

/// A variable holding `init` in `shape`.
pub(super) fn var(init: Vec<f32>, shape: &[usize]) -> Result<Var> {
    let t = Tensor::from_vec(init, shape, &candle_core::Device::Cpu).map_err(cerr)?;
    Var::from_tensor(&t).map_err(cerr)
}

/// The step loop's epochs and progress: epoch `e`'s batches are planned
/// once, with seed `seed + e`; a progress bar from the resumed step; the
/// run's pace reported at the end.
pub(super) struct Schedule<'a> {
    samples: &'a [Sample],
    train_idx: &'a [usize],
    batch_tokens: usize,
    max_len: usize,
    seed: u64,
    /// Batches per epoch.
    pub(super) per_epoch: usize,
    /// Steps of the whole run.
    pub(super) steps: usize,
    /// Where this invocation stops (`stop_after`, or the whole run).
    pub(super) limit: usize,
    plans: HashMap<usize, Vec<Vec<usize>>>,
    bar: indicatif::ProgressBar,
    start: Option<(usize, std::time::Instant)>,
}

impl<'a> Schedule<'a> {
    pub(super) fn new(
        samples: &'a [Sample],
        train_idx: &'a [usize],
        batch_tokens: usize,
        max_len: usize,
        seed: u64,
        epochs: f64,
        stop_after: usize,
    ) -> Self {
        let per_epoch = plan_batches(samples, train_idx, batch_tokens, max_len, 0).len();
        let steps = ((per_epoch as f64 * epochs).ceil() as usize).max(1);
        let limit = if stop_after > 0 {
            steps.min(stop_after)
        } else {
            steps
        };
        let bar = indicatif::ProgressBar::new(steps as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} step {pos}/{len}  {msg}  {elapsed} elapsed, ~{eta} left",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Self {
            samples,
            train_idx,
            batch_tokens,
            max_len,
            seed,
            per_epoch,
            steps,
            limit,
            plans: HashMap::new(),
            bar,
            start: None,
        }
    }

    /// The sample indices of step `step`'s batch.
    pub(super) fn batch(&mut self, step: usize) -> &[usize] {
        if self.start.is_none() {
            self.bar.set_position(step as u64);
            self.start = Some((step, std::time::Instant::now()));
        }
        let epoch = step / self.per_epoch;
        let (samples, idx, bt, ml) = (
            self.samples,
            self.train_idx,
            self.batch_tokens,
            self.max_len,
        );
        let seed = self.seed.wrapping_add(epoch as u64);
        let plan = self
            .plans
            .entry(epoch)
            .or_insert_with(|| plan_batches(samples, idx, bt, ml, seed));
        &plan[step % self.per_epoch]
    }

    /// A step is done (`done` steps in all): show `msg`; whether a
    /// checkpoint is due (every `every` steps, and at the limit).
    pub(super) fn done(&self, done: usize, every: usize, msg: String) -> bool {
        self.bar.set_message(msg);
        self.bar.inc(1);
        done.is_multiple_of(every.max(1)) || done == self.limit
    }

    /// Clear the bar and report the pace of this invocation's steps.
    pub(super) fn finish(self, done: usize) {
        self.bar.finish_and_clear();
        if let Some((start, t)) = self.start {
            let ran = done.saturating_sub(start);
            if ran > 0 {
                eprintln!(
                    "specd distill: {ran} steps in {:.0} s ({:.2} s/step)",
                    t.elapsed().as_secs_f64(),
                    t.elapsed().as_secs_f64() / ran as f64
                );
            }
        }
    }
}

/// `n` seeded normal draws of standard deviation `std` (Box-Muller).
pub(super) fn gauss(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u1, u2) = (rng.next_f64().max(1e-12), rng.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
        })
        .collect()
}

/// Keep the trainer's freed memory in the process. A step allocates and
/// frees gigabytes of tensors, many above glibc's mmap threshold; by
/// default each is mapped fresh and given back, so every step pays the
/// kernel to zero its pages again (a third of a step's time on the
/// 2-core machines). Heap-only allocation without trimming makes a step's
/// memory a reuse of the last one's. Trainers are their own processes (or
/// tests), so keeping the peak is the right trade.
pub(super) fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation parameters; it is
    // called with documented parameters and values, and memory already
    // allocated (mapped or not) is still freed correctly.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// A trainer's data: its samples (cut to `max_len`), the target's
/// recorded states of `layers`, the draft vocabulary and the seeded
/// train/validation split.
pub(super) struct Prepared {
    pub(super) samples: Vec<Sample>,
    pub(super) features: Features,
    pub(super) vocab: DraftVocab,
    pub(super) train_idx: Vec<usize>,
    pub(super) val_idx: Vec<usize>,
}

/// How much data, and how it is split: (draft vocabulary rows, the head
/// an `--init` run continues (whose draft vocabulary it keeps), seed,
/// validation fraction).
pub(super) type Split<'a> = (usize, Option<&'a InitHead>, u64, f64);

/// Samples (generated or read from a corpus, cached in `train_dir`), the
/// target's states of `layers` (cached too), the draft vocabulary and the
/// split: what every feature-reading trainer starts from. The draft
/// vocabulary is `init`'s where the run continues a written head (its
/// output rows are those tokens), else the one the data chooses.
pub(super) fn prepare(
    target: &std::sync::Arc<Model>,
    tok: &std::sync::Arc<Tokenizer>,
    data: &DataConfig,
    train_dir: &Path,
    max_len: usize,
    layers: &[usize],
    (dv, init, seed, val_fraction): Split<'_>,
) -> Result<Prepared> {
    let t0 = std::time::Instant::now();
    let mut samples = training_data(target, tok, data, train_dir)?;
    eprintln!(
        "specd distill: samples ready in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    let t0 = std::time::Instant::now();
    truncate(&mut samples, max_len);
    let features = extract_features(
        target,
        &samples,
        layers,
        &train_dir.join("features.safetensors"),
    )?;
    eprintln!(
        "specd distill: features ready in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    let tc = &target.config;
    let vocab = match init {
        Some(i) => {
            eprintln!(
                "specd distill: starting from {} (its draft vocabulary of {} tokens)",
                i.path.display(),
                i.ids.len()
            );
            draft_vocab_of(&samples, i.ids.clone(), tc.vocab_size)
        }
        None => draft_vocab(&samples, dv, tc.vocab_size, &tc.eos_token_ids),
    };
    let (train_idx, val_idx) = super::split(samples.len(), seed, val_fraction);
    if train_idx.is_empty() {
        return Err(serr("no training samples".into()));
    }
    Ok(Prepared {
        samples,
        features,
        vocab,
        train_idx,
        val_idx,
    })
}

/// The target's output head rows of `ids`, `ids.len() x h` f32.
pub fn target_head_rows(target: &Model, ids: &[u32]) -> Vec<f32> {
    let h = target.config.hidden;
    let w = target
        .weights
        .output
        .as_ref()
        .unwrap_or(&target.weights.embed);
    let mut th = vec![0f32; ids.len() * h];
    for (i, &t) in ids.iter().enumerate() {
        w.dequantize_row(t as usize, &mut th[i * h..(i + 1) * h]);
    }
    th
}

/// What a run reads that its checkpoint must have been written with:
/// `--corpus`, `--corpus-shards`, `--init`.
pub(super) type RunSource<'a> = (
    &'a Option<PathBuf>,
    &'a Option<std::ops::Range<usize>>,
    &'a Option<PathBuf>,
);

/// A checkpoint in `train_dir` resumes only the run that wrote it: on
/// other data or from another start its weights would continue on what
/// they were not trained for. `saved` is the checkpointed run's source,
/// `this` this run's; `init` this run's start, whose draft vocabulary
/// must still be the one the checkpointed run trained (the drafter
/// `export` wrote beside the checkpoint, `out/model.safetensors`): a
/// start replaced since would put other tokens on the trained rows.
pub(super) fn check_resume(
    kind: &'static str,
    train_dir: &Path,
    saved: RunSource<'_>,
    this: RunSource<'_>,
    init: Option<&InitHead>,
) -> Result<()> {
    let err = |e: String| SpecdError::InvalidRequest(format!("distill {kind}: {e}"));
    for (flag, differs, a, b) in [
        (
            "--corpus",
            saved.0 != this.0,
            format!("{:?}", saved.0),
            format!("{:?}", this.0),
        ),
        (
            "--corpus-shards",
            saved.1 != this.1,
            format!("{:?}", saved.1),
            format!("{:?}", this.1),
        ),
        (
            "--init",
            saved.2 != this.2,
            format!("{:?}", saved.2),
            format!("{:?}", this.2),
        ),
    ] {
        if differs {
            return Err(err(format!(
                "{} holds the checkpoint of a run with {flag} {a}, this run has {b}; give the same to resume it, or delete the directory to start over",
                train_dir.display()
            )));
        }
    }
    let Some(init) = init else { return Ok(()) };
    let Some(out) = train_dir.parent() else {
        return Ok(());
    };
    // The drafter written at the last checkpoint carries the vocabulary
    // the run trained.
    let Ok(written) = InitHead::read(out, kind, String::new(), usize::MAX) else {
        return Ok(());
    };
    if written.ids != init.ids {
        return Err(err(format!(
            "{}: its draft vocabulary is not the one the checkpoint in {} was trained with (the --init directory changed since); delete the run's directory to start over",
            init.path.display(),
            train_dir.display()
        )));
    }
    Ok(())
}

/// A trained proposer as its trainer's `export` wrote it
/// (`model.safetensors` with `d2t`), to continue training from with
/// `--init`: its tensors, the prefix of their names, its draft vocabulary.
pub(super) struct InitHead {
    pub(super) path: PathBuf,
    /// The trainer (`eagle`, `mtp`, `dflash`), for messages.
    kind: &'static str,
    file: TensorFile,
    prefix: String,
    /// Target ids of the draft vocabulary (`d2t` resolved).
    pub(super) ids: Vec<u32>,
}

impl InitHead {
    /// `dir/model.safetensors`, whose tensors are named `prefix` + the
    /// trainer's names, for a target of `vocab` tokens.
    pub(super) fn read(
        dir: &Path,
        kind: &'static str,
        prefix: String,
        vocab: usize,
    ) -> Result<Self> {
        let err = |e: String| SpecdError::InvalidRequest(format!("distill {kind}: {e}"));
        let path = dir.join("model.safetensors");
        let file = TensorFile::read(&path).map_err(err)?;
        let d2t = file
            .i64("d2t")
            .map_err(|e| err(format!("{}: {e} (no draft vocabulary)", path.display())))?;
        let ids = d2t
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let t = i as i64 + d;
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < vocab)
                    .ok_or_else(|| {
                        err(format!(
                            "{}: d2t[{i}] names token {t}, outside the target's vocabulary of {vocab}",
                            path.display()
                        ))
                    })
            })
            .collect::<Result<Vec<u32>>>()?;
        // Each draft row names its own token (`t2d` inverts the map).
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        if let Some(i) = ids.iter().position(|t| !seen.insert(*t)) {
            return Err(err(format!(
                "{}: d2t[{i}] names token {} a second time",
                path.display(),
                ids[i]
            )));
        }
        Ok(Self {
            path,
            kind,
            file,
            prefix,
            ids,
        })
    }

    /// Trainable tensor `name`, which must have `shape`.
    pub(super) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let err = |e: String| SpecdError::InvalidRequest(format!("distill {}: {e}", self.kind));
        let full = format!("{}{name}", self.prefix);
        match self.file.shape(&full) {
            None => Err(err(format!(
                "{}: no tensor `{full}` (--init takes what `distill {}` wrote)",
                self.path.display(),
                self.kind
            ))),
            Some(s) if s != shape => Err(err(format!(
                "{}: tensor `{full}` has shape {s:?}, this run's is {shape:?} (give the settings it was trained with: {})",
                self.path.display(),
                if self.kind == "dflash" {
                    "--intermediate, --layers, --target-layer-ids, the target"
                } else {
                    "--intermediate, --feature-layers, the target"
                }
            ))),
            Some(_) => self
                .file
                .f32(&full)
                .map_err(|e| err(format!("{}: {e}", self.path.display()))),
        }
    }

    /// Every tensor of `shapes` is there at its shape (before any data is
    /// made, so a wrong directory fails first).
    pub(super) fn check<N: AsRef<str>>(&self, shapes: &[(N, Vec<usize>)]) -> Result<()> {
        for (name, shape) in shapes {
            self.tensor(name.as_ref(), shape)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: &[u32]) -> Sample {
        Sample {
            tokens: t.to_vec(),
            prompt_len: 1,
        }
    }

    /// Recorded states are reused only for the samples they are of: the
    /// key differs for other tokens and for another split into samples of
    /// the same total length.
    #[test]
    fn the_samples_key_tells_apart_samples_of_the_same_length() {
        let a = vec![s(&[1, 2, 3]), s(&[4, 5])];
        assert_eq!(samples_key(&a), samples_key(&a.clone()));
        assert_ne!(samples_key(&a), samples_key(&[s(&[1, 2, 3]), s(&[4, 6])]));
        assert_ne!(samples_key(&a), samples_key(&[s(&[1, 2]), s(&[3, 4, 5])]));
        assert_eq!(samples_key(&a).len(), 16);
    }
}

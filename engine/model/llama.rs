//! The Llama-family forward (Llama, SmolLM2, Mistral, Qwen2): GQA, RoPE,
//! RMSNorm, SwiGLU, optional Q/K/V biases, tied or separate output head.
//!
//! One forward takes several sequences with ragged lengths, each at its own
//! position (its cache length), and returns per-sequence logits for the last
//! or every input position, plus hidden states of requested layers.

use rayon::prelude::*;

use super::kernels::{self, Activations, QMatrix};
use super::kv::{KvCache, KvDtype};
use super::{ModelConfig, RopeStyle};
use crate::error::{Result, SpecdError};

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
}

#[derive(Debug, Clone)]
pub struct Weights {
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None`: tied to `embed`.
    pub output: Option<QMatrix>,
}

/// Which positions of a sequence's input need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// Attention among a forward's new tokens, for tree verification.
/// `parents[i]` is the index (among the new tokens) of token i's parent, or
/// `None` if it hangs off the committed context. Token i attends to the
/// whole committed context plus its ancestors and itself; its position is
/// `cache_len + depth(i)`. A linear chain is `parents[i] = i - 1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeMask {
    pub parents: Vec<Option<usize>>,
}

impl TreeMask {
    pub fn chain(n: usize) -> Self {
        Self {
            parents: (0..n).map(|i| i.checked_sub(1)).collect(),
        }
    }

    fn depths(&self) -> Vec<usize> {
        let mut d = vec![0; self.parents.len()];
        for i in 0..self.parents.len() {
            d[i] = match self.parents[i] {
                Some(p) => d[p] + 1,
                None => 0,
            };
        }
        d
    }

    /// `allowed[i][j]`: new token i may attend to new token j.
    fn allowed(&self) -> Vec<Vec<bool>> {
        let n = self.parents.len();
        let mut m = vec![vec![false; n]; n];
        for i in 0..n {
            let mut cur = Some(i);
            while let Some(c) = cur {
                m[i][c] = true;
                cur = self.parents[c];
            }
        }
        m
    }

    fn validate(&self) -> Result<()> {
        for (i, p) in self.parents.iter().enumerate() {
            if let Some(p) = p {
                if *p >= i {
                    return Err(SpecdError::InvalidRequest(format!(
                        "tree mask: parent {p} of token {i} must precede it"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// One sequence's part of a batched forward.
#[derive(Debug)]
pub struct SeqInput<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub logits: Logits,
    pub tree: Option<&'a TreeMask>,
}

#[derive(Debug, Clone, Default)]
pub struct SeqOutput {
    /// `rows x vocab`, row-major: one row for `Last`, one per token for `All`.
    pub logits: Vec<f32>,
    pub rows: usize,
    /// `(layer, rows x hidden)` for each requested layer, every input token.
    /// Layer `l < layers` is the residual stream after block `l`; layer
    /// `layers` is the final-normed hidden state fed to the output head.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

impl SeqOutput {
    pub fn row(&self, r: usize) -> &[f32] {
        let v = self.logits.len() / self.rows.max(1);
        &self.logits[r * v..(r + 1) * v]
    }
}

#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    /// cos/sin per position, `head_dim / 2` each.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    pool: rayon::ThreadPool,
    kernel_path: kernels::KernelPath,
    kv_dtype: KvDtype,
}

/// Default thread count: the machine's available parallelism.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights, threads: usize) -> Result<Self> {
        let half = config.head_dim / 2;
        let theta: Vec<f32> = (0..half)
            .map(|i| {
                1f32 / config
                    .rope_theta
                    .powf((2 * i) as f32 / config.head_dim as f32)
            })
            .collect();
        let n = config.max_seq_len;
        let mut rope_cos = Vec::with_capacity(n * half);
        let mut rope_sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &t in &theta {
                let a = p as f32 * t;
                rope_cos.push(a.cos());
                rope_sin.push(a.sin());
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("specd-compute-{i}"))
            .build()
            .map_err(|e| SpecdError::InvalidRequest(format!("thread pool: {e}")))?;
        Ok(Self {
            config,
            weights,
            rope_cos,
            rope_sin,
            pool,
            kernel_path: kernels::KernelPath::best(),
            kv_dtype: KvDtype::default(),
        })
    }

    /// Quantize every F32 matrix (with rows of whole 32-blocks) to Q8_0, so
    /// a safetensors model runs on the integer kernels. Returns how many
    /// matrices changed.
    pub fn quantize_f32_to_q8_0(&mut self) -> usize {
        let mut n = 0;
        let mut q = |m: &mut QMatrix| {
            if let Some(x) = m.to_q8_0() {
                *m = x;
                n += 1;
            }
        };
        q(&mut self.weights.embed);
        if let Some(o) = self.weights.output.as_mut() {
            q(o);
        }
        for l in &mut self.weights.layers {
            for m in [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ] {
                q(m);
            }
        }
        n
    }

    /// Bytes of weights held in memory (matrices as repacked, plus norms).
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let mut total = w.embed.size_bytes()
            + w.output.as_ref().map_or(0, |o| o.size_bytes())
            + w.norm.len() * 4;
        for l in &w.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                total += m.size_bytes();
            }
            total += (l.attn_norm.len() + l.ffn_norm.len()) * 4;
            for b in [&l.bq, &l.bk, &l.bv].into_iter().flatten() {
                total += b.len() * 4;
            }
        }
        total
    }

    /// The quantized-kernel implementation this model runs.
    pub fn kernel_path(&self) -> kernels::KernelPath {
        self.kernel_path
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        let mut layout = self.config.kv_layout(super::DEFAULT_BLOCK_SIZE);
        layout.dtype = self.kv_dtype;
        KvCache::new(layout, self.config.max_seq_len)
    }

    /// Element type of caches made by `new_cache` from now on (default
    /// f16; f32 for full-precision reference comparisons).
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        self.kv_dtype = dtype;
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Convenience: forward one sequence.
    pub fn forward_one(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<SeqOutput> {
        let mut out = self.forward(
            &mut [SeqInput {
                cache,
                tokens,
                logits,
                tree: None,
            }],
            &[],
        )?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Batched forward. Appends every sequence's tokens to its cache.
    pub fn forward(
        &self,
        seqs: &mut [SeqInput<'_>],
        hidden_layers: &[usize],
    ) -> Result<Vec<SeqOutput>> {
        self.pool
            .install(|| self.forward_inner(seqs, hidden_layers))
    }

    fn forward_inner(
        &self,
        seqs: &mut [SeqInput<'_>],
        hidden_layers: &[usize],
    ) -> Result<Vec<SeqOutput>> {
        let c = &self.config;
        let (hd, nh, nkv, dim) = (c.head_dim, c.heads, c.kv_heads, c.hidden);
        let kv_dim = nkv * hd;
        for &l in hidden_layers {
            if l > c.layers {
                return Err(SpecdError::InvalidRequest(format!(
                    "hidden state of layer {l} requested; the model has {} layers",
                    c.layers
                )));
            }
        }
        // Per-token bookkeeping across the whole batch.
        struct SeqMeta {
            start: usize,
            n: usize,
            base: usize,
            allowed: Option<Vec<Vec<bool>>>,
        }
        let mut metas = Vec::with_capacity(seqs.len());
        let mut positions = Vec::new();
        let mut start = 0;
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            for &t in s.tokens {
                if t as usize >= c.vocab_size {
                    return Err(SpecdError::InvalidRequest(format!(
                        "token id {t} is outside the vocabulary ({})",
                        c.vocab_size
                    )));
                }
            }
            let base = s.cache.len();
            s.cache.reserve(n)?;
            let allowed = match s.tree {
                Some(t) => {
                    if t.parents.len() != n {
                        return Err(SpecdError::InvalidRequest(format!(
                            "tree mask has {} nodes for {n} tokens",
                            t.parents.len()
                        )));
                    }
                    t.validate()?;
                    positions.extend(t.depths().into_iter().map(|d| base + d));
                    Some(t.allowed())
                }
                None => {
                    positions.extend(base..base + n);
                    None
                }
            };
            metas.push(SeqMeta {
                start,
                n,
                base,
                allowed,
            });
            start += n;
        }
        let total = start;
        let mut outputs: Vec<SeqOutput> = (0..seqs.len()).map(|_| SeqOutput::default()).collect();
        if total == 0 {
            return Ok(outputs);
        }

        // Residual stream, total x dim.
        let mut x = vec![0f32; total * dim];
        {
            let mut i = 0;
            for s in seqs.iter() {
                for &t in s.tokens {
                    self.weights
                        .embed
                        .dequantize_row(t as usize, &mut x[i * dim..(i + 1) * dim]);
                    i += 1;
                }
            }
        }
        let mut h = vec![0f32; total * dim];
        let mut act = Activations::new(self.kernel_path);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut attn = vec![0f32; total * dim];
        let mut o = Vec::new();
        let (mut g, mut d) = (Vec::new(), Vec::new());
        let mut hidden: Vec<(usize, Vec<f32>)> = Vec::new();
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        // Sequence index of every batch row (fixed for the whole forward).

        // Attention tasks: (sequence, kv head, tokens t0..t1, cache blocks
        // c0..c1). Long contexts are split into fixed slot ranges (by
        // absolute position, so the split never depends on the batch) whose
        // partial softmax sums are merged in order afterwards.
        let mut attn_tasks = Vec::new();
        for (si, m) in metas.iter().enumerate() {
            // A decode or verify forward keeps all its tokens in one task
            // (the cache is read once) and spreads over the slot ranges.
            let per_task = if m.n <= ATTN_VERIFY_TOKENS {
                m.n
            } else {
                ATTN_TOKENS_PER_TASK
            };
            let chunks = m.n.div_ceil(per_task.max(1)).max(1);
            let per = m.n.div_ceil(chunks).max(1);
            let nblocks = seqs[si].cache.layout().blocks_for(m.base + m.n);
            // Ranges become separate tasks only when the tokens give few
            // (decode, verify); a prefill chunk's tasks walk their ranges in
            // turn and merge them the same way, so the bits are the same.
            let range = if chunks <= 2 {
                ATTN_BLOCKS_PER_RANGE
            } else {
                nblocks.max(1)
            };
            for g in 0..nkv {
                let mut t0 = 0;
                while t0 < m.n {
                    let t1 = (t0 + per).min(m.n);
                    let mut c0 = 0;
                    while c0 < nblocks {
                        let c1 = (c0 + range).min(nblocks);
                        attn_tasks.push((si, g, t0, t1, c0, c1));
                        c0 = c1;
                    }
                    t0 = t1;
                }
            }
        }

        for (li, lw) in self.weights.layers.iter().enumerate() {
            kernels::rms_norm(&x, &lw.attn_norm, c.rms_eps, &mut h);
            act.prepare(&h, total, dim, kernels::wants_q8(&lw.wq));
            kernels::matmul_many(
                &act,
                &[&lw.wq, &lw.wk, &lw.wv],
                &mut [&mut q, &mut k, &mut v],
            );
            add_bias(&mut q, lw.bq.as_deref());
            add_bias(&mut k, lw.bk.as_deref());
            add_bias(&mut v, lw.bv.as_deref());
            for (t, &p) in positions.iter().enumerate() {
                self.rope(&mut q[t * dim..(t + 1) * dim], p);
                self.rope(&mut k[t * kv_dim..(t + 1) * kv_dim], p);
            }
            for (s, m) in seqs.iter_mut().zip(&metas) {
                for t in 0..m.n {
                    let r = m.start + t;
                    s.cache.write(
                        li,
                        m.base + t,
                        &k[r * kv_dim..(r + 1) * kv_dim],
                        &v[r * kv_dim..(r + 1) * kv_dim],
                    );
                }
            }
            // Attention: one task per (sequence, kv head, chunk of tokens),
            // covering the query heads that share the kv head; each reads
            // only its own sequence's cache, in slot order, and every
            // (token, head) result is computed the same way whatever else
            // shares the task, so results do not depend on the batch.
            {
                let caches: Vec<&KvCache> = seqs.iter().map(|s| &*s.cache).collect();
                let q = &q;
                let metas = &metas;
                let outs: Vec<Vec<f32>> = attn_tasks
                    .par_iter()
                    .map(|&(si, g, t0, t1, c0, c1)| {
                        let m = &metas[si];
                        let aq = AttnQuery {
                            q,
                            dim,
                            group,
                            row0: m.start,
                            base: m.base,
                            tree: m.allowed.as_deref(),
                        };
                        let mut out = Vec::new();
                        if c1 - c0 <= ATTN_BLOCKS_PER_RANGE {
                            attend(caches[si], li, g, &aq, t0..t1, c0..c1, scale, &mut out);
                            return out;
                        }
                        // Several ranges in one task: merge them here, in
                        // order, and hand back (0, 1, result), which the
                        // merge below passes through unchanged.
                        let parts: Vec<Vec<f32>> = (c0..c1)
                            .step_by(ATTN_BLOCKS_PER_RANGE)
                            .map(|r| {
                                let mut p = Vec::new();
                                let r1 = (r + ATTN_BLOCKS_PER_RANGE).min(c1);
                                attend(caches[si], li, g, &aq, t0..t1, r..r1, scale, &mut p);
                                p
                            })
                            .collect();
                        let nq = (t1 - t0) * group;
                        out.resize(nq * (hd + 2), 0.0);
                        for qi in 0..nq {
                            let part = &mut out[qi * (hd + 2)..(qi + 1) * (hd + 2)];
                            part[0] = 0.0;
                            part[1] = 1.0;
                            merge_partials(
                                parts.iter().map(|p| &p[qi * (hd + 2)..(qi + 1) * (hd + 2)]),
                                &mut part[2..],
                            );
                        }
                        out
                    })
                    .collect();
                // Merge each (token, head)'s slot ranges in order.
                let w = group * hd;
                let mut i = 0;
                while i < attn_tasks.len() {
                    let (si, g, t0, t1, _, _) = attn_tasks[i];
                    let mut j = i;
                    while j < attn_tasks.len()
                        && attn_tasks[j].0 == si
                        && attn_tasks[j].1 == g
                        && attn_tasks[j].2 == t0
                    {
                        j += 1;
                    }
                    for t in t0..t1 {
                        let r = metas[si].start + t;
                        let dst = &mut attn[r * dim + g * w..r * dim + (g + 1) * w];
                        for h in 0..group {
                            let qi = (t - t0) * group + h;
                            merge_partials(
                                outs[i..j]
                                    .iter()
                                    .map(|o| &o[qi * (hd + 2)..(qi + 1) * (hd + 2)]),
                                &mut dst[h * hd..(h + 1) * hd],
                            );
                        }
                    }
                    i = j;
                }
            }
            act.prepare(&attn, total, dim, kernels::wants_q8(&lw.wo));
            kernels::matmul_many(&act, &[&lw.wo], &mut [&mut o]);
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
            kernels::rms_norm(&x, &lw.ffn_norm, c.rms_eps, &mut h);
            act.prepare(&h, total, dim, kernels::wants_q8(&lw.w_gate));
            kernels::matmul_swiglu(&act, &lw.w_gate, &lw.w_up, &mut g);
            act.prepare(&g, total, c.intermediate, kernels::wants_q8(&lw.w_down));
            kernels::matmul_many(&act, &[&lw.w_down], &mut [&mut d]);
            for (xv, dv) in x.iter_mut().zip(&d) {
                *xv += dv;
            }
            if hidden_layers.contains(&li) {
                hidden.push((li, x.clone()));
            }
        }
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            s.cache.advance(n);
        }

        kernels::rms_norm(&x, &self.weights.norm, c.rms_eps, &mut h);
        if hidden_layers.contains(&c.layers) {
            hidden.push((c.layers, h.clone()));
        }
        // Output head over the rows that want logits.
        let mut rows = Vec::new();
        for (s, m) in seqs.iter().zip(&metas) {
            match s.logits {
                Logits::None => {}
                Logits::Last if m.n > 0 => rows.push(m.start + m.n - 1),
                Logits::Last => {}
                Logits::All => rows.extend(m.start..m.start + m.n),
            }
        }
        let head = self.weights.output.as_ref().unwrap_or(&self.weights.embed);
        let mut sel = Vec::with_capacity(rows.len() * dim);
        for &r in &rows {
            sel.extend_from_slice(&h[r * dim..(r + 1) * dim]);
        }
        let mut logits = Vec::new();
        if !rows.is_empty() {
            act.prepare(&sel, rows.len(), dim, kernels::wants_q8(head));
            kernels::matmul_many(&act, &[head], &mut [&mut logits]);
        }
        let vocab = c.vocab_size;
        let mut cursor = 0;
        for ((s, m), out) in seqs.iter().zip(&metas).zip(outputs.iter_mut()) {
            let nrows = match s.logits {
                Logits::None => 0,
                Logits::Last => usize::from(m.n > 0),
                Logits::All => m.n,
            };
            out.rows = nrows;
            out.logits = logits[cursor * vocab..(cursor + nrows) * vocab].to_vec();
            cursor += nrows;
            for (l, hs) in &hidden {
                out.hidden
                    .push((*l, hs[m.start * dim..(m.start + m.n) * dim].to_vec()));
            }
        }
        Ok(outputs)
    }

    /// The output head over `rows` final-normed hidden rows (`rows x vocab`).
    pub fn lm_head(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let head = self.weights.output.as_ref().unwrap_or(&self.weights.embed);
        let mut act = Activations::new(self.kernel_path);
        act.prepare(hidden, rows, self.config.hidden, kernels::wants_q8(head));
        let mut logits = Vec::new();
        self.pool
            .install(|| kernels::matmul_many(&act, &[head], &mut [&mut logits]));
        logits
    }

    fn rope(&self, x: &mut [f32], pos: usize) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(hd) {
            match self.config.rope_style {
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (a, b) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = a * cos[i] - b * sin[i];
                        head[2 * i + 1] = a * sin[i] + b * cos[i];
                    }
                }
                RopeStyle::Neox => {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        head[i] = a * cos[i] - b * sin[i];
                        head[i + half] = b * cos[i] + a * sin[i];
                    }
                }
            }
        }
    }
}

fn add_bias(x: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            for (v, bv) in row.iter_mut().zip(b) {
                *v += bv;
            }
        }
    }
}

/// Query tokens per attention task (a task widens each cache block to f32
/// once for all its tokens).
const ATTN_TOKENS_PER_TASK: usize = 4;

/// Forwards of at most this many tokens per sequence (decode, verify) keep
/// a sequence's tokens in one attention task per (kv head, slot range).
const ATTN_VERIFY_TOKENS: usize = 16;

/// Cache blocks per attention slot range. Ranges sit at fixed absolute
/// positions and their partial softmax sums are merged in order, so a
/// token's result never depends on the batch; short ranges let a single
/// decoding or verifying sequence spread over the threads.
const ATTN_BLOCKS_PER_RANGE: usize = 2;

/// Merge partial attention results `[max, sum, o[head_dim]]` of consecutive
/// slot ranges, in order: `out = sum_c o_c e^(m_c - M) / sum_c s_c e^(m_c - M)`.
fn merge_partials<'a>(parts: impl Iterator<Item = &'a [f32]> + Clone, out: &mut [f32]) {
    let mx = parts.clone().fold(f32::NEG_INFINITY, |a, p| a.max(p[0]));
    out.fill(0.0);
    let mut sum = 0f32;
    for p in parts {
        if p[0] == f32::NEG_INFINITY {
            continue;
        }
        let e = kernels::exp_f32(p[0] - mx);
        sum = p[1].mul_add(e, sum);
        for (o, &v) in out.iter_mut().zip(&p[2..]) {
            *o = v.mul_add(e, *o);
        }
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// Where one sequence's queries are in the batch.
struct AttnQuery<'a> {
    /// All queries of the batch, `rows x dim`.
    q: &'a [f32],
    dim: usize,
    /// Query heads per kv head.
    group: usize,
    /// Batch row of the sequence's first new token.
    row0: usize,
    /// Cache slot of the first new token.
    base: usize,
    /// Tree mask (new-token ancestors), or `None` for a chain.
    tree: Option<&'a [Vec<bool>]>,
}

impl AttnQuery<'_> {
    /// Whether new token `t` may see cache slot `slot` (`slot <= base + t`).
    #[inline]
    fn visible(&self, t: usize, slot: usize) -> bool {
        if slot < self.base {
            return true;
        }
        let j = slot - self.base;
        match self.tree {
            Some(a) => a[t][j],
            None => j <= t,
        }
    }
}

/// Most queries (heads of one token) the 64-slot loops take at once.
const MAXQ: usize = 4;

/// The slices `f(qi)` for up to `MAXQ` queries, on the stack.
#[inline]
fn gather<'a>(qis: std::ops::Range<usize>, f: impl Fn(usize) -> &'a [f32]) -> [&'a [f32]; MAXQ] {
    let mut a: [&[f32]; MAXQ] = [&[]; MAXQ];
    for (slot, qi) in a.iter_mut().zip(qis) {
        *slot = f(qi);
    }
    a
}

/// For each query `qs[i]` (`i < MAXQ`), 64 dot products
/// `q . kt[d][c..c + 64]`, each accumulated over `d` in order. The
/// queries share every load of `kt` (up to 16 independent FMA chains).
#[inline]
fn scores64(qs: &[&[f32]], kt: &[f32], stride: usize, c: usize, out: &mut [[[f32; 16]; 4]; MAXQ]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::attn::available() {
        return super::simd::attn::scores64(qs, kt, stride, c, out);
    }
    scores64_portable(qs, kt, stride, c, out)
}

fn scores64_portable(
    qs: &[&[f32]],
    kt: &[f32],
    stride: usize,
    c: usize,
    out: &mut [[[f32; 16]; 4]; MAXQ],
) {
    for (q, acc) in qs.iter().zip(out.iter_mut()) {
        *acc = [[0f32; 16]; 4];
        for (d, &qd) in q.iter().enumerate() {
            let k: &[f32; 64] = kt[d * stride + c..d * stride + c + 64].try_into().unwrap();
            for (a, kc) in acc.iter_mut().zip(k.chunks_exact(16)) {
                for l in 0..16 {
                    a[l] = qd.mul_add(kc[l], a[l]);
                }
            }
        }
    }
}

/// Sixteen dot products (the tail of a block that is not a multiple of 64).
#[inline]
fn scores16(qrow: &[f32], kt: &[f32], stride: usize, c: usize) -> [f32; 16] {
    let mut acc = [0f32; 16];
    for (d, &qd) in qrow.iter().enumerate() {
        let k: &[f32; 16] = kt[d * stride + c..d * stride + c + 16].try_into().unwrap();
        for l in 0..16 {
            acc[l] = qd.mul_add(k[l], acc[l]);
        }
    }
    acc
}

/// For each query `i`: `acc[i][k][l] += ps[i][j] * v[j][c + 16k + l]` for
/// slots `j` in order (all `ps[i]` have the same length); the queries share
/// every load of `v`.
#[inline]
fn pv64(ps: &[&[f32]], v: &[f32], hd: usize, c: usize, acc: &mut [[[f32; 16]; 4]; MAXQ]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::attn::available() {
        return super::simd::attn::pv64(ps, v, hd, c, acc);
    }
    pv64_portable(ps, v, hd, c, acc)
}

fn pv64_portable(ps: &[&[f32]], v: &[f32], hd: usize, c: usize, acc: &mut [[[f32; 16]; 4]; MAXQ]) {
    for (p, a) in ps.iter().zip(acc.iter_mut()) {
        for (j, &pj) in p.iter().enumerate() {
            let vr: &[f32; 64] = v[j * hd + c..j * hd + c + 64].try_into().unwrap();
            for (ak, vc) in a.iter_mut().zip(vr.chunks_exact(16)) {
                for l in 0..16 {
                    ak[l] = pj.mul_add(vc[l], ak[l]);
                }
            }
        }
    }
}

/// Attention of the query heads sharing `kv_head` for new tokens `ts` of
/// one sequence, over cache blocks `blocks`. `out` becomes, per (token,
/// head) in order, `[max, sum, o[head_dim]]`: the largest scaled score over
/// the visible slots of the range, the sum of `e^(score - max)`, and the
/// value sum weighted by those terms (`merge_partials` combines ranges).
///
/// Scores are `head_dim`-ordered FMA chains, the sums run in slot order
/// (invisible slots are -inf, adding exactly zero), and the cache is read
/// one block at a time, widened from f16 once for all of the task's tokens.
#[allow(clippy::too_many_arguments)]
fn attend(
    cache: &KvCache,
    layer: usize,
    kv_head: usize,
    aq: &AttnQuery<'_>,
    ts: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    scale: f32,
    out: &mut Vec<f32>,
) {
    let l = cache.layout();
    let (hd, bs, group) = (l.head_dim, l.block_size, aq.group);
    let nt = ts.len();
    let nq = nt * group;
    // Token t sees slots below base + t + 1 at most.
    let end_max = aq.base + ts.end;
    let b1 = blocks.end.min(l.blocks_for(end_max));
    let b0 = blocks.start.min(b1);
    let span = (b1 - b0) * bs;
    // Per-thread scratch, reused across tasks (every score read below is
    // written first, so stale contents never matter).
    thread_local! {
        static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    let (mut scores, mut wide) = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if scores.len() < nq * span {
        scores.resize(nq * span, 0.0);
    }
    let qrow = |qi: usize| {
        let (t, h) = (ts.start + qi / group, qi % group);
        let o = (aq.row0 + t) * aq.dim + (kv_head * group + h) * hd;
        &aq.q[o..o + hd]
    };
    // Visible slots of block b for the queries of local token ti.
    let limit = |ti: usize, b: usize| (aq.base + ts.start + ti + 1).saturating_sub(b * bs).min(bs);
    let mut acc4 = [[[0f32; 16]; 4]; MAXQ];
    for b in b0..b1 {
        let lb = b - b0;
        let buf = cache.keys_t(layer, kv_head, b).widen(&mut wide);
        // The heads of one token share a limit; take them MAXQ at a time.
        for ti in 0..nt {
            let lim = limit(ti, b);
            if lim == 0 {
                continue;
            }
            for h0 in (0..group).step_by(MAXQ) {
                let qis = ti * group + h0..ti * group + (h0 + MAXQ).min(group);
                let qa = gather(qis.clone(), qrow);
                let qs = &qa[..qis.len()];
                let mut c = 0;
                while c < lim {
                    if c + 64 <= bs {
                        scores64(qs, buf, bs, c, &mut acc4);
                        for (qi, acc) in qis.clone().zip(&acc4) {
                            let sc =
                                &mut scores[qi * span + lb * bs + c..qi * span + lb * bs + c + 64];
                            for (k, a) in acc.iter().enumerate() {
                                sc[16 * k..16 * (k + 1)].copy_from_slice(a);
                            }
                        }
                        c += 64;
                    } else {
                        for (qi, q) in qis.clone().zip(qs) {
                            let sc = &mut scores[qi * span + lb * bs..qi * span + (lb + 1) * bs];
                            let mut cc = c;
                            while cc < bs {
                                if cc + 16 <= bs {
                                    sc[cc..cc + 16].copy_from_slice(&scores16(q, buf, bs, cc));
                                    cc += 16;
                                } else {
                                    for s in cc..bs {
                                        let mut acc = 0f32;
                                        for (d, &qd) in q.iter().enumerate() {
                                            acc = qd.mul_add(buf[d * bs + s], acc);
                                        }
                                        sc[s] = acc;
                                    }
                                    cc = bs;
                                }
                            }
                        }
                        c = bs;
                    }
                }
            }
        }
    }
    // Per query: scale and mask, the range's max, e^(x - max) and its sum.
    out.clear();
    out.resize(nq * (hd + 2), 0.0);
    for qi in 0..nq {
        let t = ts.start + qi / group;
        let end = (aq.base + t + 1).min(b1 * bs);
        let first = b0 * bs;
        let n = end.saturating_sub(first);
        let sc = &mut scores[qi * span..qi * span + n];
        if aq.tree.is_none() {
            // A chain token sees every slot up to its own.
            for v in sc.iter_mut() {
                *v *= scale;
            }
        } else {
            for (j, v) in sc.iter_mut().enumerate() {
                *v = if aq.visible(t, first + j) {
                    *v * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        let part = &mut out[qi * (hd + 2)..(qi + 1) * (hd + 2)];
        let (mx, sum) = kernels::exp_shifted(sc);
        part[0] = mx;
        part[1] = sum;
    }
    for b in b0..b1 {
        let lb = b - b0;
        let buf = cache.values(layer, kv_head, b).widen(&mut wide);
        for ti in 0..nt {
            let lim = limit(ti, b);
            if lim == 0 {
                continue;
            }
            // Invisible slots have p = 0 (exp of -inf), so the FMA leaves
            // the sums unchanged.
            for h0 in (0..group).step_by(MAXQ) {
                let qis = ti * group + h0..ti * group + (h0 + MAXQ).min(group);
                let pa = gather(qis.clone(), |qi| {
                    &scores[qi * span + lb * bs..qi * span + lb * bs + lim]
                });
                let ps = &pa[..qis.len()];
                let mut c = 0;
                while c < hd {
                    if c + 64 <= hd {
                        for (qi, acc) in qis.clone().zip(acc4.iter_mut()) {
                            let o = &out[qi * (hd + 2) + 2 + c..qi * (hd + 2) + 2 + c + 64];
                            for (k, a) in acc.iter_mut().enumerate() {
                                a.copy_from_slice(&o[16 * k..16 * (k + 1)]);
                            }
                        }
                        pv64(ps, buf, hd, c, &mut acc4);
                        for (qi, acc) in qis.clone().zip(&acc4) {
                            let o = &mut out[qi * (hd + 2) + 2 + c..qi * (hd + 2) + 2 + c + 64];
                            for (k, a) in acc.iter().enumerate() {
                                o[16 * k..16 * (k + 1)].copy_from_slice(a);
                            }
                        }
                        c += 64;
                    } else {
                        for (qi, p) in qis.clone().zip(ps) {
                            let o = &mut out[qi * (hd + 2) + 2..(qi + 1) * (hd + 2)];
                            for (j, &pj) in p.iter().enumerate() {
                                for d in c..hd {
                                    o[d] = pj.mul_add(buf[j * hd + d], o[d]);
                                }
                            }
                        }
                        c = hd;
                    }
                }
            }
        }
    }
    SCRATCH.with(|s| *s.borrow_mut() = (scores, wide));
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The SIMD attention loops (AVX-512 where available, and AVX2) give
    /// the portable loops' bits.
    #[test]
    fn simd_attention_loops_match_portable_bits() {
        use super::super::simd::attn;
        if !attn::available() {
            return;
        }
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let (hd, bs) = (64usize, 64usize);
        for nq in 1..=MAXQ {
            let qv: Vec<Vec<f32>> = (0..nq).map(|_| (0..hd).map(|_| rnd()).collect()).collect();
            let qs: Vec<&[f32]> = qv.iter().map(|q| q.as_slice()).collect();
            let kt: Vec<f32> = (0..hd * bs).map(|_| rnd()).collect();
            let (mut a, mut b) = ([[[0f32; 16]; 4]; MAXQ], [[[0f32; 16]; 4]; MAXQ]);
            let mut c = a;
            attn::scores64(&qs, &kt, bs, 0, &mut a);
            attn::scores64_avx2(&qs, &kt, bs, 0, &mut c);
            scores64_portable(&qs, &kt, bs, 0, &mut b);
            assert_eq!(a[..nq], b[..nq]);
            assert_eq!(c[..nq], b[..nq]);
            let pv: Vec<Vec<f32>> = (0..nq)
                .map(|_| (0..37).map(|_| rnd().abs()).collect())
                .collect();
            let ps: Vec<&[f32]> = pv.iter().map(|p| p.as_slice()).collect();
            let v: Vec<f32> = (0..37 * 128).map(|_| rnd()).collect();
            let init = [[[0.25f32; 16]; 4]; MAXQ];
            let (mut a, mut b, mut c) = (init, init, init);
            attn::pv64(&ps, &v, 128, 64, &mut a);
            attn::pv64_avx2(&ps, &v, 128, 64, &mut c);
            pv64_portable(&ps, &v, 128, 64, &mut b);
            assert_eq!(a[..nq], b[..nq]);
            assert_eq!(c[..nq], b[..nq]);
        }
        let h: Vec<half::f16> = (0..100).map(|_| half::f16::from_f32(rnd())).collect();
        let mut w = vec![0f32; 100];
        attn::widen(&h, &mut w);
        assert!(h.iter().zip(&w).all(|(h, w)| h.to_f32() == *w));
    }
}

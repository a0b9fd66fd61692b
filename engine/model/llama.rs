//! The decoder forward of every supported architecture (Llama, SmolLM2,
//! Mistral, Qwen2, Qwen3, Gemma 3, Phi-3): GQA, RoPE (scaled, partial, a
//! base per layer), RMSNorm, SwiGLU or GeGLU, optional Q/K/V biases, q/k
//! norms and post-norms, sliding-window layers, tied or separate output
//! head. What differs between architectures is data in `ModelConfig` and
//! `LayerWeights`, never a second forward.
//!
//! One forward takes several sequences with ragged lengths, each at its own
//! position (its cache length), and returns per-sequence logits for the last
//! or every input position, plus hidden states of requested layers.

pub use super::attention::TreeMask;

use super::attention::{AttentionPlan, Dims, SeqRows};
use super::kernels::{self, Activations, QMatrix};
use super::kv::{KvCache, KvDtype};
use super::{ModelConfig, RopeScaling, RopeStyle};
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
    /// Per-head RMSNorm weights of q and k (`head_dim` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm of the attention output and of the feed-forward output,
    /// before each residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl LayerWeights {
    /// A layer with only the Llama parts (the options empty).
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        attn_norm: Vec<f32>,
        [wq, wk, wv, wo]: [QMatrix; 4],
        [bq, bk, bv]: [Option<Vec<f32>>; 3],
        ffn_norm: Vec<f32>,
        [w_gate, w_up, w_down]: [QMatrix; 3],
    ) -> Self {
        Self {
            attn_norm,
            wq,
            wk,
            wv,
            bq,
            bk,
            bv,
            wo,
            ffn_norm,
            w_gate,
            w_up,
            w_down,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_ffn_norm: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Weights {
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None`: tied to `embed`.
    pub output: Option<QMatrix>,
}

impl Weights {
    /// Every matrix (the output head once, if tied) and every vector
    /// (norms, biases) the model holds.
    fn parts(&self) -> (Vec<&QMatrix>, Vec<&[f32]>) {
        let mut mats: Vec<&QMatrix> = vec![&self.embed];
        mats.extend(&self.output);
        let mut vecs: Vec<&[f32]> = vec![&self.norm];
        for l in &self.layers {
            mats.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
            vecs.extend([&l.attn_norm[..], &l.ffn_norm[..]]);
            vecs.extend(
                [
                    &l.bq,
                    &l.bk,
                    &l.bv,
                    &l.q_norm,
                    &l.k_norm,
                    &l.post_attn_norm,
                    &l.post_ffn_norm,
                ]
                .into_iter()
                .flatten()
                .map(|b| &b[..]),
            );
        }
        (mats, vecs)
    }
}

/// Which positions of a sequence's input need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    /// The last n positions (a prefill's last chunk with drafts after it).
    Tail(usize),
    All,
}

impl Logits {
    /// How many of a forward's last rows (of `len`) have logits.
    pub fn rows_at_end(&self, len: usize) -> usize {
        match *self {
            Logits::None => 0,
            Logits::Last => len.min(1),
            Logits::Tail(n) => n.min(len),
            Logits::All => len,
        }
    }
}

/// One sequence's part of a batched forward.
#[derive(Debug)]
pub struct ForwardInput<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub logits: Logits,
    pub tree: Option<&'a TreeMask>,
}

#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    /// `rows x vocab`, row-major: one row for `Last`, one per token for `All`.
    pub logits: Vec<f32>,
    pub rows: usize,
    /// `(layer, rows x hidden)` for each requested layer, every input token.
    /// Layer `l < layers` is the residual stream after block `l`; layer
    /// `layers` is the final-normed hidden state fed to the output head.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

impl ForwardOutput {
    pub fn row(&self, r: usize) -> &[f32] {
        let v = self.logits.len() / self.rows.max(1);
        &self.logits[r * v..(r + 1) * v]
    }
}

#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    /// Rotary tables (one per distinct base and scaling), and which
    /// table each layer uses.
    ropes: Vec<RopeTable>,
    layer_rope: Vec<usize>,
    pool: rayon::ThreadPool,
    /// Forwards run on the calling thread's own pool (`with_caller_pool`)
    /// instead of `pool`: a model a proposer plugin drafts with, called
    /// from the engine's thread several times a propose.
    on_caller_pool: bool,
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
        let mut ropes: Vec<RopeTable> = Vec::new();
        let mut keys: Vec<(f32, RopeScaling)> = Vec::new();
        let mut layer_rope = Vec::with_capacity(config.layers);
        for li in 0..config.layers {
            let (theta, scaling) = config.layer_rope(li);
            let i = match keys.iter().position(|(t, s)| *t == theta && s == scaling) {
                Some(i) => i,
                None => {
                    ropes.push(RopeTable::new(&config, theta, scaling)?);
                    keys.push((theta, scaling.clone()));
                    ropes.len() - 1
                }
            };
            layer_rope.push(i);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("specd-compute-{i}"))
            .build()
            .map_err(|e| SpecdError::InvalidRequest(format!("thread pool: {e}")))?;
        Ok(Self {
            config,
            weights,
            ropes,
            layer_rope,
            pool,
            on_caller_pool: false,
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
        let (mats, vecs) = self.weights.parts();
        mats.iter().map(|m| m.size_bytes()).sum::<usize>()
            + vecs.iter().map(|v| v.len() * 4).sum::<usize>()
    }

    /// Drop every weight from the CPU caches, so the next forward reads
    /// them from memory (benchmarks; see [`kernels::evict_from_caches`]).
    /// Returns whether this CPU could.
    pub fn evict_weights_from_caches(&self) -> bool {
        use rayon::prelude::*;
        let (mats, vecs) = self.weights.parts();
        // On the compute threads, as a forward would run.
        self.pool.install(|| {
            mats.par_iter().all(|m| m.evict_from_caches())
                & vecs.par_iter().all(|v| kernels::evict_from_caches(v))
        })
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

    /// Bytes one position takes in a cache from `new_cache` (every layer's
    /// keys and values; sliding layers counted whole: an upper bound).
    pub fn kv_bytes_per_token(&self) -> usize {
        let mut layout = self.config.kv_layout(1);
        layout.dtype = self.kv_dtype;
        layout.block_bytes()
    }

    /// Convenience: forward one sequence.
    pub fn forward_one(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let mut out = self.forward(
            &mut [ForwardInput {
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
        seqs: &mut [ForwardInput<'_>],
        hidden_layers: &[usize],
    ) -> Result<Vec<ForwardOutput>> {
        self.run(|| self.forward_inner(seqs, hidden_layers))
    }

    /// Run `f` (a forward's work) on the compute threads, their idle ones
    /// helping: this model's pool, or the caller's own
    /// (`run_on_caller_pool`).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.on_caller_pool && join_caller_pool(self.pool.current_num_threads()) {
            with_helpers(f)
        } else {
            self.pool.install(|| with_helpers(f))
        }
    }

    /// Run forwards on the calling thread's own pool (`join_caller_pool`,
    /// as wide as this model's: the caller works as worker 0, two thread
    /// wake-ups fewer a forward) instead of this model's pool, which then
    /// sits idle; a thread whose own pool has another width, or that is in
    /// another pool, still uses this model's. For a model a proposer
    /// plugin drafts with, called many times a step from the engine's
    /// thread.
    pub fn run_on_caller_pool(&mut self) {
        self.on_caller_pool = true;
    }

    fn forward_inner(
        &self,
        seqs: &mut [ForwardInput<'_>],
        hidden_layers: &[usize],
    ) -> Result<Vec<ForwardOutput>> {
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
            let (allowed, ancestors) = match s.tree {
                Some(t) => {
                    if t.parents.len() != n {
                        return Err(SpecdError::InvalidRequest(format!(
                            "tree mask has {} nodes for {n} tokens",
                            t.parents.len()
                        )));
                    }
                    t.validate()?;
                    positions.extend(t.depths().into_iter().map(|d| base + d));
                    (Some(t.allowed()), Some(t.ancestors()))
                }
                None => {
                    positions.extend(base..base + n);
                    (None, None)
                }
            };
            metas.push(SeqRows {
                start,
                n,
                base,
                allowed,
                ancestors,
            });
            start += n;
        }
        let total = start;
        let mut outputs: Vec<ForwardOutput> =
            (0..seqs.len()).map(|_| ForwardOutput::default()).collect();
        if total == 0 {
            return Ok(outputs);
        }
        let qd = c.q_dim();

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
            if let Some(e) = c.embed_scale {
                for v in x.iter_mut() {
                    *v *= e;
                }
            }
        }
        let mut h = vec![0f32; total * dim];
        let mut act = Activations::new(self.kernel_path);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut attn = vec![0f32; total * qd];
        let mut o = Vec::new();
        let (mut g, mut d) = (Vec::new(), Vec::new());
        let mut normed = Vec::new();
        let mut hidden: Vec<(usize, Vec<f32>)> = Vec::new();
        let group = nh / nkv;
        // One attention plan per distinct window (global and sliding).
        let plans: Vec<(Option<usize>, AttentionPlan)> = {
            let caches: Vec<&KvCache> = seqs.iter().map(|s| &*s.cache).collect();
            let mut windows: Vec<Option<usize>> =
                (0..c.layers).map(|l| c.layer_window(l)).collect();
            windows.sort();
            windows.dedup();
            windows
                .into_iter()
                .map(|w| (w, AttentionPlan::new(&metas, &caches, nkv, w)))
                .collect()
        };

        // Decode and verify forwards ask for each layer's cache blocks
        // before its first product (a prefill chunk's tasks re-read the
        // blocks it is writing, in the caches already).
        let prefetch = metas
            .iter()
            .all(|m| m.n <= super::attention::ATTN_VERIFY_TOKENS);
        for (li, lw) in self.weights.layers.iter().enumerate() {
            let window = c.layer_window(li);
            let plan = plans
                .iter()
                .find(|(w, _)| *w == window)
                .map(|(_, p)| p)
                .expect("a plan per window");
            if prefetch {
                let caches: Vec<&KvCache> = seqs.iter().map(|s| &*s.cache).collect();
                plan.prefetch(&caches, li);
            }
            norm_rows(&x, &lw.attn_norm, c.rms_eps, &mut h);
            act.prepare(&h, total, dim, kernels::wants_q8(&lw.wq));
            kernels::matmul_many(
                &act,
                &[&lw.wq, &lw.wk, &lw.wv],
                &mut [&mut q, &mut k, &mut v],
            );
            add_bias(&mut q, lw.bq.as_deref());
            add_bias(&mut k, lw.bk.as_deref());
            add_bias(&mut v, lw.bv.as_deref());
            if let Some(w) = &lw.q_norm {
                norm_in_place(&mut q, w, c.rms_eps, &mut normed);
            }
            if let Some(w) = &lw.k_norm {
                norm_in_place(&mut k, w, c.rms_eps, &mut normed);
            }
            let rope = &self.ropes[self.layer_rope[li]];
            let rotate = |q: &mut [f32], k: &mut [f32], ps: &[usize]| {
                for ((q, k), &p) in q
                    .chunks_exact_mut(qd)
                    .zip(k.chunks_exact_mut(kv_dim))
                    .zip(ps)
                {
                    rope.apply(q, p, hd, c.rope_style);
                    rope.apply(k, p, hd, c.rope_style);
                }
            };
            if total < PAR_ROWS {
                rotate(&mut q, &mut k, &positions);
            } else {
                let jobs: Vec<_> = q
                    .chunks_mut(ROWS_A_TASK * qd)
                    .zip(k.chunks_mut(ROWS_A_TASK * kv_dim))
                    .zip(positions.chunks(ROWS_A_TASK))
                    .collect();
                kernels::team::for_each(jobs, |((q, k), ps)| rotate(q, k, ps));
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
            {
                let caches: Vec<&KvCache> = seqs.iter().map(|s| &*s.cache).collect();
                let dims = Dims {
                    dim: qd,
                    head_dim: hd,
                    group,
                    scale: c.attn_scale,
                };
                plan.run(&caches, &metas, li, &q, dims, &mut attn);
            }
            act.prepare(&attn, total, qd, kernels::wants_q8(&lw.wo));
            kernels::matmul_many(&act, &[&lw.wo], &mut [&mut o]);
            if let Some(w) = &lw.post_attn_norm {
                norm_in_place(&mut o, w, c.rms_eps, &mut normed);
            }
            add_rows(&mut x, &o, dim);
            norm_rows(&x, &lw.ffn_norm, c.rms_eps, &mut h);
            act.prepare(&h, total, dim, kernels::wants_q8(&lw.w_gate));
            kernels::matmul_glu(&act, &lw.w_gate, &lw.w_up, c.activation, &mut g);
            act.prepare(&g, total, c.intermediate, kernels::wants_q8(&lw.w_down));
            kernels::matmul_many(&act, &[&lw.w_down], &mut [&mut d]);
            if let Some(w) = &lw.post_ffn_norm {
                norm_in_place(&mut d, w, c.rms_eps, &mut normed);
            }
            add_rows(&mut x, &d, dim);
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
            let end = m.start + m.n;
            rows.extend(end - s.logits.rows_at_end(m.n)..end);
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
            softcap(&mut logits, c.final_logit_softcap);
        }
        let vocab = c.vocab_size;
        // One sequence (decode and verify at batch 1) takes the buffers
        // whole instead of copying them (rows x vocab logits: 1.5 MiB for
        // an 8-token verify; no change bench-model's noise lets through).
        if let ([s], [m], [out]) = (&seqs[..], &metas[..], &mut outputs[..]) {
            out.rows = s.logits.rows_at_end(m.n);
            out.logits = logits;
            out.hidden = hidden;
            return Ok(outputs);
        }
        let mut cursor = 0;
        for ((s, m), out) in seqs.iter().zip(&metas).zip(outputs.iter_mut()) {
            let nrows = s.logits.rows_at_end(m.n);
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

    /// The rotary cos and sin layer `layer` applies at position `pos`
    /// (`rotary_dim / 2` each, YaRN's attention factor included).
    pub fn rope_at(&self, layer: usize, pos: usize) -> (&[f32], &[f32]) {
        let t = &self.ropes[self.layer_rope[layer]];
        let h = t.half;
        (
            &t.cos[pos * h..(pos + 1) * h],
            &t.sin[pos * h..(pos + 1) * h],
        )
    }

    /// The output head over `rows` final-normed hidden rows (`rows x vocab`).
    pub fn lm_head(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let head = self.weights.output.as_ref().unwrap_or(&self.weights.embed);
        let mut act = Activations::new(self.kernel_path);
        act.prepare(hidden, rows, self.config.hidden, kernels::wants_q8(head));
        let mut logits = Vec::new();
        self.run(|| kernels::matmul_many(&act, &[head], &mut [&mut logits]));
        softcap(&mut logits, self.config.final_logit_softcap);
        logits
    }
}

/// cos/sin of every position for one RoPE base and scaling, over the
/// rotary dimensions (`rotary_dim / 2` frequencies).
#[derive(Debug)]
struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// The RoPE frequencies of `rot` rotary dimensions (`rot / 2` of them)
/// for base `theta` under `scaling`, and the factor cos and sin are
/// multiplied by (YaRN's and LongRoPE's attention factor, else 1). The
/// target's tables and EAGLE heads' come from here.
pub(crate) fn rope_frequencies(
    rot: usize,
    theta: f32,
    scaling: &RopeScaling,
) -> Result<(Vec<f32>, f32)> {
    let half = rot / 2;
    let mut freqs: Vec<f32> = (0..half)
        .map(|i| 1f32 / theta.powf((2 * i) as f32 / rot as f32))
        .collect();
    match scaling {
        RopeScaling::None | RopeScaling::Yarn { .. } => {}
        RopeScaling::Linear { factor } => {
            for f in &mut freqs {
                *f /= factor;
            }
        }
        RopeScaling::Factors(div)
        | RopeScaling::LongRope {
            factors: div,
            attention_factor: _,
        } => {
            if div.len() != half {
                return Err(SpecdError::InvalidRequest(format!(
                    "rope frequency factors: {} values for {half} frequencies",
                    div.len()
                )));
            }
            for (f, d) in freqs.iter_mut().zip(div) {
                *f /= d;
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let old = *original_max_position as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            for f in &mut freqs {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                if wavelen < high_wavelen {
                    // High frequencies kept.
                } else if wavelen > low_wavelen {
                    *f /= factor;
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
    }
    let mut mscale = match scaling {
        RopeScaling::LongRope {
            attention_factor, ..
        } => *attention_factor,
        _ => 1f32,
    };
    if let RopeScaling::Yarn {
        factor,
        original_max_position,
        beta_fast,
        beta_slow,
        attention_factor,
    } = scaling
    {
        // The dimension pair that turns `rotations` times over the
        // original context, then a linear ramp between those of
        // `beta_fast` and `beta_slow` (floored and ceiled, clamped).
        let orig = *original_max_position as f32;
        let corr = |rotations: f32| {
            rot as f32 * (orig / (rotations * 2.0 * std::f32::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let low = corr(*beta_fast).floor().max(0.0);
        let high = corr(*beta_slow).ceil().min(rot as f32 - 1.0);
        let high = if high == low { high + 0.001 } else { high };
        for (i, f) in freqs.iter_mut().enumerate() {
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolate = 1.0 - ramp;
            *f = *f / factor * (1.0 - extrapolate) + *f * extrapolate;
        }
        mscale = attention_factor.unwrap_or(if *factor > 1.0 {
            0.1 * factor.ln() + 1.0
        } else {
            1.0
        });
    }
    Ok((freqs, mscale))
}

impl RopeTable {
    fn new(c: &ModelConfig, theta: f32, scaling: &RopeScaling) -> Result<Self> {
        let half = c.rotary_dim / 2;
        let (freqs, mscale) = rope_frequencies(c.rotary_dim, theta, scaling)?;
        let n = c.max_seq_len;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &t in &freqs {
                let a = p as f32 * t;
                cos.push(a.cos() * mscale);
                sin.push(a.sin() * mscale);
            }
        }
        Ok(Self { half, cos, sin })
    }

    /// Rotate the leading rotary dimensions of every `hd`-wide head of `x`
    /// to position `pos`.
    fn apply(&self, x: &mut [f32], pos: usize, hd: usize, style: RopeStyle) {
        let half = self.half;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(hd) {
            match style {
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

/// RMSNorm of each `w.len()`-wide row of `x` in place (per-head q/k norms,
/// post-norms), through `scratch`.
fn norm_in_place(x: &mut [f32], w: &[f32], eps: f32, scratch: &mut Vec<f32>) {
    scratch.resize(x.len(), 0.0);
    kernels::rms_norm(x, w, eps, scratch);
    x.copy_from_slice(scratch);
}

/// `v = cap * tanh(v / cap)` for every logit, where a cap is set.
fn softcap(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        for v in logits.iter_mut() {
            *v = cap * (*v / cap).tanh();
        }
    }
}

/// Forwards of at least this many rows split their row-wise steps (norms,
/// residual adds, rotary embedding) over the threads, `ROWS_A_TASK` rows a
/// task; fewer rows (decode, verify) run them on the forward's thread, as
/// a hand-off costs more than they do. Each row is computed by the same
/// code either way, so the split changes no bit.
const PAR_ROWS: usize = 64;
const ROWS_A_TASK: usize = 32;

/// `out = rms_norm(x)` row by row (`kernels::rms_norm`), split over the
/// threads for prefill-sized inputs.
fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    if x.len() < PAR_ROWS * dim {
        return kernels::rms_norm(x, w, eps, out);
    }
    let jobs: Vec<_> = x
        .chunks(ROWS_A_TASK * dim)
        .zip(out.chunks_mut(ROWS_A_TASK * dim))
        .collect();
    kernels::team::for_each(jobs, |(x, out)| kernels::rms_norm(x, w, eps, out));
}

/// `x += a` (the residual stream), split over the threads as `norm_rows`.
fn add_rows(x: &mut [f32], a: &[f32], dim: usize) {
    let add = |x: &mut [f32], a: &[f32]| {
        for (xv, av) in x.iter_mut().zip(a) {
            *xv += av;
        }
    };
    if x.len() < PAR_ROWS * dim {
        return add(x, a);
    }
    let jobs: Vec<_> = x
        .chunks_mut(ROWS_A_TASK * dim)
        .zip(a.chunks(ROWS_A_TASK * dim))
        .collect();
    kernels::team::for_each(jobs, |(x, a)| add(x, a));
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

thread_local! {
    /// Set on the thread running a forward's serial part (`forward_inner`).
    static IN_FORWARD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as running a forward until dropped (also when the
/// forward panics).
struct InForward;

impl InForward {
    fn enter() -> Self {
        IN_FORWARD.with(|f| f.set(true));
        InForward
    }
}

impl Drop for InForward {
    fn drop(&mut self) {
        IN_FORWARD.with(|f| f.set(false));
    }
}

/// Run `f` on this thread (inside a rayon pool, or outside one: then in
/// rayon's global pool) with the pool's other threads helping: each takes
/// `f`'s parallel tasks as soon as they exist instead of sleeping between
/// them (see `keep_helping`). A model's forward runs this way, and so may
/// a proposer plugin's head, whose products are a few hundred
/// microseconds each: handed to sleeping workers one by one, each paid
/// their wake-up. Nested calls (a helper already inside a forward) run
/// `f` plainly.
pub fn with_helpers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_none() {
        // Outside any pool: into the global one, so `f` and its helpers
        // share it.
        return rayon::scope(|_| helped(f));
    }
    helped(f)
}

/// `with_helpers` for a caller outside any pool that calls again and
/// again (a proposer plugin's `propose`, on the engine's thread): that
/// thread joins a pool of its own as worker 0 (`join_caller_pool`,
/// `default_threads()` wide), so `f` runs right there with the pool's
/// other threads helping. Through the global pool `f` was handed to a
/// sleeping worker and the caller woken when it was done: two wake-ups on
/// every call's critical path, about 0.1 ms a propose. A thread already
/// in a pool, or one whose pool cannot be built, runs `with_helpers` as
/// before.
pub fn with_caller_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    join_caller_pool(default_threads());
    with_helpers(f)
}

thread_local! {
    /// This thread's own pool (`join_caller_pool`) and its width.
    static CALLER_POOL: std::cell::OnceCell<Option<(usize, rayon::ThreadPool)>> =
        const { std::cell::OnceCell::new() };
}

/// Make the calling thread worker 0 of a pool of its own, `threads` wide
/// (rayon's `use_current_thread`), unless it is in a pool already; the
/// pool is kept for the thread's life, its other threads exiting with it.
/// Returns whether the thread is now worker 0 of such a pool exactly
/// `threads` wide (the first call's width stays the thread's).
///
/// *Invariant:* at most one such pool per thread and per copy of rayon
/// (each plugin library links its own), so the threads this adds are
/// bounded by the threads that call times the libraries they call.
pub fn join_caller_pool(threads: usize) -> bool {
    let threads = threads.max(1);
    CALLER_POOL.with(|p| {
        if p.get().is_none() && rayon::current_thread_index().is_none() {
            let built = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .use_current_thread()
                .thread_name(|i| format!("specd-helper-{i}"))
                .build()
                .ok()
                .map(|pool| (threads, pool));
            let _ = p.set(built);
        }
        matches!(p.get(), Some(Some((w, _))) if *w == threads)
    })
}

/// `with_helpers` on a pool thread: `f` leads a team (`kernels::team`)
/// of this thread and the pool's other threads, which take its parallel
/// sections' tasks as soon as they are published instead of sleeping
/// between them.
///
/// *Invariant:* a helper never waits on anything but this forward. It
/// returns at once on a thread that is itself running a forward (which
/// may have picked the helper up while waiting inside its own, or another
/// concurrent, forward), claims no task while it runs other rayon work,
/// and returns when `f` does.
fn helped<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if helpers == 0 || IN_FORWARD.with(|x| x.get()) {
        return f();
    }
    kernels::team::lead_with_helpers(helpers, &|| !IN_FORWARD.with(|x| x.get()), || {
        let _running = InForward::enter();
        f()
    })
}

#[cfg(test)]
mod caller_pool_tests {
    use super::*;
    use rayon::prelude::*;

    fn helper_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| {
                        std::fs::read_to_string(e.path().join("comm"))
                            .is_ok_and(|c| c.starts_with("specd-helper"))
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// A thread outside any pool becomes worker 0 of a pool of its own on
    /// its first call and runs `f` itself, with the pool's other threads
    /// taking `f`'s parallel work; later calls reuse that pool; a width
    /// other than the thread's pool's is reported; the pool's threads exit
    /// with the caller.
    #[test]
    fn the_caller_runs_f_as_worker_0_of_its_own_pool() {
        let before = helper_threads();
        std::thread::spawn(|| {
            let me = std::thread::current().id();
            assert_eq!(rayon::current_thread_index(), None);
            let (index, tid, width) = with_caller_pool(|| {
                (
                    rayon::current_thread_index(),
                    std::thread::current().id(),
                    rayon::current_num_threads(),
                )
            });
            assert_eq!(index, Some(0), "the caller is worker 0");
            assert_eq!(tid, me, "f runs on the calling thread");
            assert_eq!(width, default_threads());
            // Parallel work inside f is shared with the pool's threads.
            let seen: std::collections::HashSet<_> = with_caller_pool(|| {
                (0..64)
                    .into_par_iter()
                    .map(|_| {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        std::thread::current().id()
                    })
                    .collect()
            });
            if default_threads() > 1 {
                assert!(seen.len() > 1, "the pool's other threads helped");
            }
            assert_eq!(with_caller_pool(|| std::thread::current().id()), me);
            assert!(join_caller_pool(default_threads()));
            assert!(!join_caller_pool(default_threads() + 1));
        })
        .join()
        .unwrap();
        // The caller is gone: its pool's other threads leave too.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while helper_threads() > before && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(helper_threads(), before);
    }
}

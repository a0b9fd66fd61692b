//! Attention over the block KV cache: the tree mask for tree verification,
//! and the attention tasks of a forward.
//!
//! Tasks run per (sequence, kv head, tokens, 128-slot range at fixed
//! absolute positions). A decode or verify forward (up to 16 tokens per
//! sequence) keeps all its tokens in one task per range, so the cache is
//! read once; a prefill chunk's tasks take 16 tokens each and walk their
//! ranges in turn. A task widens each cache block once, the query heads of
//! a token share every K/V load, and the per-range partials (max, sum,
//! weighted values) are merged in range order. A tree's rows share one
//! task per context range below the range holding the tree (`Context`),
//! read once for all of them like a chain's; from that range on each row
//! is computed per query in the layout plain decoding would give its path
//! (`Tail`), and its partials merge after the context's.
//!
//! Invariant: neither the token chunking nor the slot split depends on the
//! batch, so a token's attention output is bit-identical alone or batched.

use super::kernels;
use super::kv::KvCache;
use crate::error::{Result, SpecdError};

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

    /// Whether the first `s` tokens may come from the cache instead: they
    /// form a chain off the context, and every later token descends from
    /// the last of them (so none loses an ancestor).
    pub fn skippable(&self, s: usize) -> bool {
        s <= self.parents.len()
            && self.parents[..s]
                .iter()
                .enumerate()
                .all(|(i, &p)| p == i.checked_sub(1))
            && (s == 0
                || self.parents[s..]
                    .iter()
                    .all(|&p| p.is_some_and(|p| p + 1 >= s)))
    }

    /// The mask of the tokens after the first `s` (`skippable(s)`): the
    /// token after them hangs off the context.
    pub fn after_prefix(&self, s: usize) -> Self {
        Self {
            parents: self.parents[s..]
                .iter()
                .map(|&p| p.and_then(|p| p.checked_sub(s)))
                .collect(),
        }
    }

    pub(super) fn depths(&self) -> Vec<usize> {
        let mut d = vec![0; self.parents.len()];
        for i in 0..self.parents.len() {
            d[i] = match self.parents[i] {
                Some(p) => d[p] + 1,
                None => 0,
            };
        }
        d
    }

    /// Each new token's chain of ancestors among the new tokens, the first
    /// one hanging off the context first, the token itself last.
    pub(super) fn ancestors(&self) -> Vec<Vec<usize>> {
        (0..self.parents.len())
            .map(|i| {
                let mut a = vec![i];
                let mut cur = self.parents[i];
                while let Some(c) = cur {
                    a.push(c);
                    cur = self.parents[c];
                }
                a.reverse();
                a
            })
            .collect()
    }

    /// `allowed[i][j]`: new token i may attend to new token j.
    pub(super) fn allowed(&self) -> Vec<Vec<bool>> {
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

    pub(super) fn validate(&self) -> Result<()> {
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

/// One sequence's rows in a forward: batch rows `start..start + n`, at
/// cache positions from `base`, with an optional tree mask.
#[derive(Debug)]
pub(super) struct SeqRows {
    pub start: usize,
    pub n: usize,
    pub base: usize,
    pub allowed: Option<Vec<Vec<bool>>>,
    /// Tree forwards: each new token's ancestors (new-token indices, the
    /// root first, the token itself last).
    pub ancestors: Option<Vec<Vec<usize>>>,
}

/// Shapes and the softmax scale of a forward's attention.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    /// Query row width (`heads * head_dim`).
    pub dim: usize,
    pub head_dim: usize,
    /// Query heads per kv head.
    pub group: usize,
    pub scale: f32,
}

/// What an attention task computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskKind {
    /// Chain rows over cache blocks `c0..c1` in place (`attend`; several
    /// ranges are merged inside the task): one partial per query.
    Chain,
    /// A tree's rows over one context range below the tail (the range
    /// holding the tree's first slot), which every row sees whole: one
    /// partial per query, for the row's `Tail` task to merge.
    Context,
    /// Tree rows from the tail on, each in the layout plain decoding
    /// would use (`attend_tree_tail`): a fixed number of partials per
    /// query, padded with empty ones.
    Tail,
}

/// One attention task: (sequence, kv head, tokens t0..t1, cache blocks
/// c0..c1, kind).
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv: usize,
    t0: usize,
    t1: usize,
    c0: usize,
    c1: usize,
    kind: TaskKind,
}

/// The attention tasks of one forward (the same for every layer).
#[derive(Debug)]
pub(super) struct AttentionPlan {
    /// Per sequence and kv head, contiguous: its `Chain` tasks (by tokens,
    /// then range), then its `Context` tasks (by range), then its `Tail`
    /// tasks (by tokens).
    tasks: Vec<Task>,
    /// Sliding window (positions a token sees, itself included), if any.
    window: Option<usize>,
}

/// The first cache slot a token at `pos` sees under `window`.
#[inline]
fn window_start(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

impl AttentionPlan {
    /// Tasks for `metas`, whose caches already hold room for their tokens,
    /// attending within `window` positions where set. Slot ranges wholly
    /// before every task token's window are left out: their partial sums
    /// would merge as exact no-ops, so leaving them out changes no bit.
    pub fn new(metas: &[SeqRows], caches: &[&KvCache], nkv: usize, window: Option<usize>) -> Self {
        let range_slots = |c: &KvCache| ATTN_BLOCKS_PER_RANGE * c.layout().block_size;
        // Attention tasks: (sequence, kv head, tokens t0..t1, cache blocks
        // c0..c1). Long contexts are split into fixed slot ranges (by
        // absolute position, so the split never depends on the batch) whose
        // partial softmax sums are merged in order afterwards.
        let mut tasks = Vec::new();
        for (si, m) in metas.iter().enumerate() {
            let layout = caches[si].layout();
            let bs = layout.block_size;
            let rs = range_slots(caches[si]);
            // Rows planned as a chain: all of them without a tree; with
            // one, the leading rows that form a chain off the context (a
            // prompt's last chunk before the tree drafted after it), which
            // need no tree mask and, through `attend_tree_tail`'s
            // per-query path, made a long prompt's first step with a tree
            // 20-35% slower. A short leading chain (a verify tree's root
            // and first nodes) joins the tree rows instead, so the context
            // is read once for all rows. A row's bits are the same on
            // either path.
            let chain = m.ancestors.as_deref().map_or(m.n, leading_chain);
            let chain = if chain < m.n && chain <= ATTN_TREE_TOKENS_PER_TASK {
                0
            } else {
                chain
            };
            // Chain rows: a decode or verify forward keeps all its tokens
            // in one task (the cache is read once) and spreads over the
            // slot ranges.
            let chain_plan = (chain > 0).then(|| {
                let nblocks = layout.blocks_for(m.base + chain);
                let per_task = if chain <= ATTN_VERIFY_TOKENS {
                    chain
                } else {
                    ATTN_TOKENS_PER_TASK
                };
                let chunks = chain.div_ceil(per_task.max(1)).max(1);
                let per = chain.div_ceil(chunks).max(1);
                // Ranges become separate tasks only when the tokens give
                // few (decode, verify, chunks of up to 32 tokens); a longer
                // prefill chunk's tasks walk their ranges in turn and merge
                // them the same way, so the bits are the same.
                let range = if chunks <= 2 {
                    ATTN_BLOCKS_PER_RANGE
                } else {
                    nblocks.max(1)
                };
                (nblocks, per, range)
            });
            // Tree rows: the context ranges below the tail once for all of
            // them (those before every row's window are left out), then
            // balanced chunks of at most ATTN_TREE_TOKENS_PER_TASK rows for
            // the tail, at least two tasks per thread over the kv heads.
            // (`per` >= 1 whenever the loop runs.)
            let tree_plan = (chain < m.n).then(|| {
                let tail_block = m.base / rs * rs / bs;
                let lo_min = (chain..m.n)
                    .map(|t| {
                        let depth = m.ancestors.as_deref().map_or(t, |a| a[t].len() - 1);
                        window_start(window, m.base + depth)
                    })
                    .min()
                    .unwrap_or(0);
                let ctx_block = lo_min / rs * rs / bs;
                let rows = m.n - chain;
                let spread = (2 * rayon::current_num_threads()).div_ceil(nkv.max(1));
                let chunks = rows
                    .div_ceil(ATTN_TREE_TOKENS_PER_TASK)
                    .max(spread)
                    .clamp(1, rows);
                (ctx_block.min(tail_block), tail_block, rows.div_ceil(chunks))
            });
            for g in 0..nkv {
                if let Some((nblocks, per, range)) = chain_plan {
                    let mut t0 = 0;
                    while t0 < chain {
                        let t1 = (t0 + per).min(chain);
                        // The first range any of these tokens sees (the
                        // first token's window starts lowest).
                        let lo = window_start(window, m.base + t0) / rs * rs;
                        let mut c0 = lo / bs;
                        while c0 < nblocks {
                            let c1 = (c0 + range).min(nblocks);
                            tasks.push(Task {
                                seq: si,
                                kv: g,
                                t0,
                                t1,
                                c0,
                                c1,
                                kind: TaskKind::Chain,
                            });
                            c0 = c1;
                        }
                        t0 = t1;
                    }
                }
                if let Some((ctx0, tail_block, per)) = tree_plan {
                    for c0 in (ctx0..tail_block).step_by(ATTN_BLOCKS_PER_RANGE) {
                        tasks.push(Task {
                            seq: si,
                            kv: g,
                            t0: chain,
                            t1: m.n,
                            c0,
                            c1: c0 + ATTN_BLOCKS_PER_RANGE,
                            kind: TaskKind::Context,
                        });
                    }
                    let mut t0 = chain;
                    while t0 < m.n {
                        let t1 = (t0 + per).min(m.n);
                        tasks.push(Task {
                            seq: si,
                            kv: g,
                            t0,
                            t1,
                            c0: tail_block,
                            c1: layout.blocks_for(m.base + m.n).max(tail_block),
                            kind: TaskKind::Tail,
                        });
                        t0 = t1;
                    }
                }
            }
        }

        Self { tasks, window }
    }

    /// Start bringing the cache blocks layer `layer`'s tasks will read
    /// into the CPU's caches, up to `PREFETCH_BYTES` of them in task order:
    /// issued before the layer's first product, they arrive while it
    /// runs instead of stalling the tasks line by line (between two
    /// layers the weights' stream pushes them out of the caches). A hint:
    /// it changes no value.
    pub fn prefetch(&self, caches: &[&KvCache], layer: usize) {
        let mut left = PREFETCH_BYTES;
        for task in &self.tasks {
            let cache = caches[task.seq];
            let l = cache.layout();
            let c1 = task.c1.min(cache.num_blocks());
            for b in task.c0.min(c1)..c1 {
                let bytes = 2 * l.block_size * l.head_dim * l.dtype.size();
                if bytes > left {
                    return;
                }
                left -= bytes;
                cache.keys_t(layer, task.kv, b).prefetch();
                cache.values(layer, task.kv, b).prefetch();
            }
        }
    }

    /// Attention of layer `li` for every query row of `q` into `attn`
    /// (`rows x dim`), reading each sequence's cache (which already holds
    /// this forward's keys and values).
    pub fn run(
        &self,
        caches: &[&KvCache],
        metas: &[SeqRows],
        li: usize,
        q: &[f32],
        d: Dims,
        attn: &mut [f32],
    ) {
        let Dims {
            dim,
            head_dim: hd,
            group,
            scale,
        } = d;
        let tasks = &self.tasks;
        let stride = hd + 2;
        // Attention: each task covers the query heads that share its kv
        // head; each reads only its own sequence's cache, in slot order,
        // and every (token, head) result is computed the same way whatever
        // else shares the task, so results do not depend on the batch.
        // A task hands back its partials, `per` for each query.
        let outs: Vec<(Vec<f32>, usize)> = crate::kernels::team::map(tasks, |task| {
            let m = &metas[task.seq];
            let tree_rows = task.kind != TaskKind::Chain;
            let aq = AttnQuery {
                q,
                dim,
                group,
                row0: m.start,
                base: m.base,
                tree: m.allowed.as_deref().filter(|_| tree_rows),
                ancestors: m.ancestors.as_deref().filter(|_| tree_rows),
                window: self.window,
            };
            let cache = caches[task.seq];
            let ts = task.t0..task.t1;
            let mut out = Vec::new();
            if task.kind == TaskKind::Tail {
                let anc = aq.ancestors.expect("tree rows have ancestors");
                let per = attend_tree_tail(cache, li, task.kv, &aq, anc, ts, scale, &mut out);
                return (out, per);
            }
            if task.c1 - task.c0 <= ATTN_BLOCKS_PER_RANGE {
                attend(
                    cache,
                    li,
                    task.kv,
                    &aq,
                    ts,
                    task.c0..task.c1,
                    scale,
                    &mut out,
                );
                return (out, 1);
            }
            // Several ranges in one task: merge them here, in order,
            // and hand back (0, 1, result), which the merge below
            // passes through unchanged.
            let parts: Vec<Vec<f32>> = (task.c0..task.c1)
                .step_by(ATTN_BLOCKS_PER_RANGE)
                .map(|r| {
                    let mut p = Vec::new();
                    let r1 = (r + ATTN_BLOCKS_PER_RANGE).min(task.c1);
                    attend(cache, li, task.kv, &aq, ts.clone(), r..r1, scale, &mut p);
                    p
                })
                .collect();
            let nq = ts.len() * group;
            out.resize(nq * stride, 0.0);
            for qi in 0..nq {
                let part = &mut out[qi * stride..(qi + 1) * stride];
                part[0] = 0.0;
                part[1] = 1.0;
                merge_partials(
                    parts.iter().map(|p| &p[qi * stride..(qi + 1) * stride]),
                    &mut part[2..],
                );
            }
            (out, 1)
        });
        // Merge each (token, head)'s slot ranges in order: a chain row's
        // from the tasks of its tokens (consecutive, one per range); a
        // tree row's from its sequence and kv head's `Context` tasks, then
        // its `Tail` task's.
        let w = group * hd;
        let partial = |k: usize, t: usize, h: usize, p: usize| {
            let qi = (t - tasks[k].t0) * group + h;
            let at = (qi * outs[k].1 + p) * stride;
            &outs[k].0[at..at + stride]
        };
        let mut i = 0;
        while i < tasks.len() {
            let Task { seq, kv, .. } = tasks[i];
            let mut end = i;
            while end < tasks.len() && tasks[end].seq == seq && tasks[end].kv == kv {
                end += 1;
            }
            let context: Vec<usize> = (i..end)
                .filter(|&k| tasks[k].kind == TaskKind::Context)
                .collect();
            let mut k = i;
            while k < end {
                let Task { t0, t1, kind, .. } = tasks[k];
                let mut j = k + 1;
                if kind == TaskKind::Chain {
                    while j < end
                        && tasks[j].kind == TaskKind::Chain
                        && (tasks[j].t0, tasks[j].t1) == (t0, t1)
                    {
                        j += 1;
                    }
                }
                if kind != TaskKind::Context {
                    for t in t0..t1 {
                        let r = metas[seq].start + t;
                        let dst = &mut attn[r * dim + kv * w..r * dim + (kv + 1) * w];
                        for h in 0..group {
                            let dst = &mut dst[h * hd..(h + 1) * hd];
                            if kind == TaskKind::Chain {
                                merge_partials((k..j).map(|x| partial(x, t, h, 0)), dst);
                            } else {
                                merge_partials(
                                    context
                                        .iter()
                                        .map(|&x| partial(x, t, h, 0))
                                        .chain((0..outs[k].1).map(|p| partial(k, t, h, p))),
                                    dst,
                                );
                            }
                        }
                    }
                }
                k = j;
            }
            i = end;
        }
    }
}

/// How many leading rows of a tree form a chain off the context: row `t`
/// whose ancestors are exactly rows `0..=t`.
fn leading_chain(ancestors: &[Vec<usize>]) -> usize {
    ancestors
        .iter()
        .enumerate()
        .take_while(|(t, a)| a.len() == t + 1 && a.iter().enumerate().all(|(i, &x)| x == i))
        .count()
}

/// Query tokens per attention task of a prefill chunk (a task widens each
/// cache block to f32 once for all its tokens: at 4, a 512-token chunk
/// widened every block 128 times and its attention took 89-104 ms of the
/// chunk's 340; at 16, 80-92 ms).
const ATTN_TOKENS_PER_TASK: usize = 16;

/// Tree rows per `Tail` task (a row's result does not depend on which
/// others share its task); a leading chain of at most this many rows joins
/// the tree rows.
const ATTN_TREE_TOKENS_PER_TASK: usize = 8;

/// Forwards of at most this many tokens per sequence (decode, verify) keep
/// a sequence's tokens in one attention task per (kv head, slot range).
pub(super) const ATTN_VERIFY_TOKENS: usize = 16;

/// Cache blocks per attention slot range. Ranges sit at fixed absolute
/// positions and their partial softmax sums are merged in order, so a
/// token's result never depends on the batch; short ranges let a single
/// decoding or verifying sequence spread over the threads.
pub(crate) const ATTN_BLOCKS_PER_RANGE: usize = 2;

/// Most cache bytes `AttentionPlan::prefetch` asks for a layer: a part of
/// a core's L2 (1-2 MiB on the server CPUs this runs on), so the blocks
/// are still there when the tasks read them (context 256 of SmolLM2-135M:
/// 192 KiB a layer).
const PREFETCH_BYTES: usize = 256 << 10;

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
    /// Tree tokens' ancestors (their depth is the length less one).
    ancestors: Option<&'a [Vec<usize>]>,
    /// Sliding window of this layer.
    window: Option<usize>,
}

impl AttnQuery<'_> {
    /// The position of new token `t` (a tree token's is its depth's).
    #[inline]
    fn pos(&self, t: usize) -> usize {
        match self.ancestors {
            Some(a) => self.base + a[t].len() - 1,
            None => self.base + t,
        }
    }

    /// The first slot (of plain decoding's layout) token `t` sees.
    #[inline]
    fn lo(&self, t: usize) -> usize {
        window_start(self.window, self.pos(t))
    }

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
    if super::kernels::simd::attn::available() {
        return super::kernels::simd::attn::scores64(qs, kt, stride, c, out);
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
    if super::kernels::simd::attn::available() {
        return super::kernels::simd::attn::pv64(ps, v, hd, c, acc);
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
    // The task's blocks come from memory (a forward streams the weights
    // through the caches between layers): ask for all of them at once
    // rather than wait on each line as the widening reaches it. This
    // overlaps `AttentionPlan::prefetch` for decode and verify on purpose:
    // it covers the blocks past that one's budget and prefill chunks, and
    // a prefetch of a line already in L2 costs about an instruction.
    for b in b0..b1 {
        cache.keys_t(layer, kv_head, b).prefetch();
        cache.values(layer, kv_head, b).prefetch();
    }
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
        let lo = aq.lo(t);
        if aq.tree.is_none() && lo <= first {
            // A chain token sees every slot up to its own.
            for v in sc.iter_mut() {
                *v *= scale;
            }
        } else {
            for (j, v) in sc.iter_mut().enumerate() {
                *v = if first + j >= lo && aq.visible(t, first + j) {
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

/// Scores of query `q` against slots `0..lim` of one cache block (`kt`,
/// transposed keys, `bs` slots): the same head-dim-ordered FMA chains as
/// `attend`'s key pass, so every score has the same bits.
fn block_scores(q: &[f32], kt: &[f32], bs: usize, lim: usize, sc: &mut [f32]) {
    let mut acc = [[[0f32; 16]; 4]; MAXQ];
    let mut c = 0;
    while c < lim {
        if c + 64 <= bs {
            scores64(&[q], kt, bs, c, &mut acc);
            for (k, a) in acc[0].iter().enumerate() {
                sc[c + 16 * k..c + 16 * (k + 1)].copy_from_slice(a);
            }
            c += 64;
        } else {
            while c < bs {
                if c + 16 <= bs {
                    sc[c..c + 16].copy_from_slice(&scores16(q, kt, bs, c));
                    c += 16;
                } else {
                    for s in c..bs {
                        let mut a = 0f32;
                        for (d, &qd) in q.iter().enumerate() {
                            a = qd.mul_add(kt[d * bs + s], a);
                        }
                        sc[s] = a;
                    }
                    c = bs;
                }
            }
        }
    }
}

/// `o += sum_j p[j] * v[j]` over rows `j` in order (`v`: rows of `hd`),
/// exactly as `attend`'s value pass accumulates one query.
fn value_sum(p: &[f32], v: &[f32], hd: usize, o: &mut [f32]) {
    let mut acc = [[[0f32; 16]; 4]; MAXQ];
    let mut c = 0;
    while c < hd {
        if c + 64 <= hd {
            for (k, a) in acc[0].iter_mut().enumerate() {
                a.copy_from_slice(&o[c + 16 * k..c + 16 * (k + 1)]);
            }
            pv64(&[p], v, hd, c, &mut acc);
            for (k, a) in acc[0].iter().enumerate() {
                o[c + 16 * k..c + 16 * (k + 1)].copy_from_slice(a);
            }
            c += 64;
        } else {
            for (j, &pj) in p.iter().enumerate() {
                for d in c..hd {
                    o[d] = pj.mul_add(v[j * hd + d], o[d]);
                }
            }
            c = hd;
        }
    }
}

/// Attention of tree tokens `ts` (ancestors `anc`) from the tail on (the
/// 128-slot range holding `base`), each computed exactly as plain decoding
/// computes it: over the committed context and its ancestors at
/// consecutive slots from `base` (where plain decoding puts them), with the
/// same ranges and lane sums; the ranges below the tail are the plan's
/// `Context` tasks. A token's scores and values are gathered into that
/// virtual layout. `out` holds, per query, the returned number of partials
/// `[max, sum, o]` (the most any of these tokens has), in range order,
/// padded with empty ones (`max = -inf`) that the merge skips.
#[allow(clippy::too_many_arguments)]
fn attend_tree_tail(
    cache: &KvCache,
    layer: usize,
    kv_head: usize,
    aq: &AttnQuery<'_>,
    anc: &[Vec<usize>],
    ts: std::ops::Range<usize>,
    scale: f32,
    out: &mut Vec<f32>,
) -> usize {
    let l = cache.layout();
    let (hd, bs, group) = (l.head_dim, l.block_size, aq.group);
    let range = ATTN_BLOCKS_PER_RANGE * bs;
    let base = aq.base;
    let tail = base / range * range;
    let stride = hd + 2;
    // Partials per query: the ranges of the deepest token's layout.
    let per = ts
        .clone()
        .map(|t| (base + anc[t].len() - tail).div_ceil(range))
        .max()
        .unwrap_or(0);
    // Physical blocks from `tail` up to the last slot these tokens see.
    let (tb0, tb1) = (tail / bs, l.blocks_for(base + ts.end));
    // The tail blocks widened once, into one buffer each for keys and
    // values (block k at k * bs * hd).
    let blk = bs * hd;
    let mut kwide = vec![0f32; (tb1 - tb0) * blk];
    let mut vwide = vec![0f32; (tb1 - tb0) * blk];
    {
        let mut w = Vec::new();
        for (k, b) in (tb0..tb1).enumerate() {
            kwide[k * blk..(k + 1) * blk]
                .copy_from_slice(cache.keys_t(layer, kv_head, b).widen(&mut w));
            vwide[k * blk..(k + 1) * blk]
                .copy_from_slice(cache.values(layer, kv_head, b).widen(&mut w));
        }
    }
    let kbufs: Vec<&[f32]> = kwide.chunks(blk).collect();
    let vbufs: Vec<&[f32]> = vwide.chunks(blk).collect();
    let nq = ts.len() * group;
    out.clear();
    out.resize(nq * per * stride, 0.0);
    for part in out.chunks_mut(stride) {
        part[0] = f32::NEG_INFINITY;
    }
    let mut phys = vec![0f32; (tb1 - tb0) * bs];
    let mut virt: Vec<f32> = Vec::new();
    let mut gathered: Vec<f32> = Vec::new();
    for qi in 0..nq {
        let t = ts.start + qi / group;
        let h = qi % group;
        let o0 = (aq.row0 + t) * aq.dim + (kv_head * group + h) * hd;
        let q = &aq.q[o0..o0 + hd];
        // Physical scores of every slot from `tail` to this token's own.
        let last = base + t + 1;
        for (k, b) in (tb0..tb1).enumerate() {
            let lim = last.saturating_sub(b * bs).min(bs);
            if lim > 0 {
                block_scores(q, kbufs[k], bs, lim, &mut phys[k * bs..(k + 1) * bs]);
            }
        }
        // The virtual layout: context slots as they are, then the
        // ancestors (root first) at base, base + 1, ...
        let a = &anc[t];
        let vend = base + a.len();
        virt.clear();
        virt.extend_from_slice(&phys[..base - tail]);
        virt.extend(a.iter().map(|&i| phys[base + i - tail]));
        let ranges = &mut out[qi * per * stride..(qi + 1) * per * stride];
        let mut r0 = tail;
        while r0 < vend {
            let r1 = (r0 + range).min(vend);
            let sc = &mut virt[r0 - tail..r1 - tail];
            let lo = aq.lo(t);
            for (j, v) in sc.iter_mut().enumerate() {
                *v = if r0 + j >= lo {
                    *v * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
            let (mx, sum) = kernels::exp_shifted(sc);
            let part = &mut ranges[(r0 - tail) / range * stride..][..stride];
            part[0] = mx;
            part[1] = sum;
            // Context slots of this range, block by block, in place.
            let ctx_end = r1.min(base);
            let mut s = r0;
            while s < ctx_end {
                let b = s / bs;
                let e = ctx_end.min((b + 1) * bs);
                let vb = &vbufs[b - tb0][(s - b * bs) * hd..];
                value_sum(&sc[s - r0..e - r0], vb, hd, &mut part[2..]);
                s = e;
            }
            // Ancestor slots of this range, gathered in depth order.
            if r1 > base {
                let k0 = r0.max(base) - base;
                let k1 = r1 - base;
                gathered.clear();
                for &i in &a[k0..k1] {
                    let slot = base + i;
                    let b = slot / bs;
                    let row = (slot - b * bs) * hd;
                    gathered.extend_from_slice(&vbufs[b - tb0][row..row + hd]);
                }
                let p0 = r0.max(base) - r0;
                value_sum(&sc[p0..p0 + (k1 - k0)], &gathered, hd, &mut part[2..]);
            }
            r0 = r1;
        }
    }
    per
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// A chain prefix before a tree may come from the cache; the rest's
    /// mask hangs the root off the context. A prefix that is not a chain,
    /// or a node that would lose an ancestor, may not.
    #[test]
    fn a_tree_skips_only_a_chain_prefix_every_node_descends_from() {
        // Prefix 0-2, root 3, children 4 and 5 of the root, 6 under 4.
        let t = TreeMask {
            parents: vec![None, Some(0), Some(1), Some(2), Some(3), Some(3), Some(4)],
        };
        for s in 0..=4 {
            assert!(t.skippable(s), "{s}");
        }
        // Skipping the root too would orphan both of its children.
        assert!(!t.skippable(5));
        let rest = t.after_prefix(3);
        assert_eq!(rest.parents, vec![None, Some(0), Some(0), Some(1)]);
        assert_eq!(rest.depths(), vec![0, 1, 1, 2]);
        // A node hanging off the context beside the prefix.
        let t = TreeMask {
            parents: vec![None, Some(0), None],
        };
        assert!(!t.skippable(1) && !t.skippable(2) && t.skippable(0));
        // A branch below the prefix's first token: only that token may go
        // (token 2 would see token 1 as context).
        let t = TreeMask {
            parents: vec![None, Some(0), Some(0), Some(2)],
        };
        assert!(t.skippable(1) && !t.skippable(2) && !t.skippable(3));
    }

    /// The SIMD attention loops (AVX-512 where available, and AVX2) give
    /// the portable loops' bits.
    #[test]
    fn simd_attention_loops_match_portable_bits() {
        use super::super::kernels::simd::attn;
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

//! Fused CPU training ops with their own backward passes, for the parts of
//! the heads' training graph where candle's op-by-op tensors cost more
//! than the matmuls: the draft-vocabulary soft cross-entropy and the
//! training-time-test attention.
//!
//! Invariants:
//! - Each op computes the same function as the candle composition it
//!   replaces (`tests` check values and gradients against it), up to
//!   float summation order.
//! - Inputs are read through their layouts' contiguous offsets; callers
//!   pass contiguous f32 tensors (`contiguous()` is free when they are).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::model::kernels::{dot_f32 as dot, exp_f32, exp_shifted};

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what}: f32 expected");
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what}: contiguous input expected"),
    }
}

/// `x W^T` for 2-D `x` (rows x in) and `w` (out x in) in bf16 tile
/// products with f32 sums (`kernels::bf16`, AMX), its backward the same
/// way: `dx = g W`, `dw = g^T x`, each read through transposed views
/// without copies. Only where `kernels::bf16::available()`.
pub(super) struct MatmulWt;

fn strided<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<(usize, usize, crate::model::kernels::bf16::Strided<'a>)> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{what}: f32 expected");
    };
    let (dims, st) = (l.dims(), l.stride());
    if dims.len() != 2 {
        candle_core::bail!("{what}: 2-D expected, got {:?}", l.shape());
    }
    let data = &v[l.start_offset()..];
    Ok((
        dims[0],
        dims[1],
        crate::model::kernels::bf16::Strided {
            data,
            rs: st[0],
            cs: st[1],
        },
    ))
}

impl CustomOp2 for MatmulWt {
    fn name(&self) -> &'static str {
        "matmul-wt-bf16"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k, a) = strided(sx, lx, "matmul x")?;
        let (n, k2, b) = strided(sw, lw, "matmul w")?;
        if k != k2 {
            candle_core::bail!("matmul: x {:?} against w {:?}", lx.shape(), lw.shape());
        }
        let mut out = vec![0f32; m * n];
        crate::model::kernels::bf16::gemm(m, n, k, a, b, &mut out);
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = grad_res.apply_op2_no_bwd(&w.t()?, &MatmulWt)?;
        let dw = grad_res.t()?.apply_op2_no_bwd(&x.t()?, &MatmulWt)?;
        Ok((Some(dx), Some(dw)))
    }
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `sum_r w_r * CE(softmax(target_r), log_softmax(logits_r))`: the soft
/// cross-entropy of each row's logits against the distribution of its
/// target logits, weighted per row (a weight of 0 leaves a row out). The
/// target logits get no gradient. The forward pass keeps the gradient in
/// the logits, `w_r * (softmax(logits_r) - softmax(target_r))`, for the
/// backward pass (one pass over the logits each way).
pub(super) struct SoftCrossEntropy {
    weights: Arc<Vec<f32>>,
    grad: Mutex<Option<Tensor>>,
}

impl SoftCrossEntropy {
    pub(super) fn new(weights: Vec<f32>) -> Self {
        Self {
            weights: Arc::new(weights),
            grad: Mutex::new(None),
        }
    }
}

impl CustomOp2 for SoftCrossEntropy {
    fn name(&self) -> &'static str {
        "soft_ce"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (logits, target) = (slice(s1, l1, "soft_ce")?, slice(s2, l2, "soft_ce")?);
        let rows = self.weights.len();
        if rows == 0 || logits.len() != target.len() || logits.len() % rows != 0 {
            candle_core::bail!(
                "soft_ce: {} logits, {} targets, {rows} rows",
                logits.len(),
                target.len()
            );
        }
        let n = logits.len() / rows;
        let mut grad = vec![0f32; logits.len()];
        let loss: f64 = grad
            .par_chunks_mut(n)
            .zip(logits.par_chunks(n).zip(target.par_chunks(n)))
            .zip(self.weights.par_iter())
            .filter(|(_, &w)| w != 0.0)
            .map_init(Vec::new, |p: &mut Vec<f32>, ((gr, (l, t)), &w)| {
                gr.copy_from_slice(l);
                let (ml, sl) = exp_shifted(gr);
                p.clear();
                p.extend_from_slice(t);
                let (_, st) = exp_shifted(p);
                let (il, it) = (1.0 / sl, 1.0 / st);
                // CE = lse(l) - sum_j p_j l_j.
                let pl: f32 = p.iter().zip(l).map(|(&p, &l)| p * l).sum::<f32>() * it;
                for (g, &p) in gr.iter_mut().zip(p.iter()) {
                    *g = w * (*g * il - p * it);
                }
                f64::from(w) * f64::from(ml + sl.ln() - pl)
            })
            .sum();
        let shape = l1.shape().clone();
        let grad = Tensor::from_vec(grad, shape, &candle_core::Device::Cpu)?;
        *self.grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(grad);
        Ok((CpuStorage::F32(vec![loss as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        _logits: &Tensor,
        _target: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(grad) = self.grad.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("soft_ce: backward before forward (or twice)");
        };
        let g = grad_res.to_scalar::<f32>()?;
        let grad = if g == 1.0 {
            grad
        } else {
            (grad * f64::from(g))?
        };
        Ok((Some(grad), None))
    }
}

/// The attention of a head unrolled by training-time test, at TTT step
/// `extra` (0: plain causal attention). `q` is `(b, heads, t, hd)`; `k`
/// and `v` are `(b, kv_heads, (extra + 1) * t, hd)`: the step-0 keys of
/// every position, then the keys of steps 1..=extra. Row `p` of every
/// query head attends to step-0 keys `0..=p` of its kv head and to its own
/// row `p` of each later step's keys, scaled by `1/sqrt(hd)`.
///
/// The step-0 products run as batched matmuls (the query heads of a kv
/// head stacked as one `(g * t, hd)` matrix); masking, softmax and the
/// per-row later-step keys are one fused pass each way.
pub(super) struct TttAttention {
    pub(super) extra: usize,
    /// The forward's attention weights, kept for the backward pass.
    saved: Mutex<Option<Saved>>,
}

struct Saved {
    /// `(b, nkv, g * t, t)` weights of the step-0 keys (0 above the
    /// diagonal).
    p: Tensor,
    /// `(b * nh * t, extra)` weights of the later steps' own keys.
    pe: Vec<f32>,
}

impl TttAttention {
    pub(super) fn new(extra: usize) -> Self {
        Self {
            extra,
            saved: Mutex::new(None),
        }
    }
}

struct Dims {
    b: usize,
    nh: usize,
    nkv: usize,
    t: usize,
    hd: usize,
}

impl Dims {
    fn g(&self) -> usize {
        self.nh / self.nkv
    }
}

fn dims(extra: usize, q: &Shape, k: &Shape, v: &Shape) -> Result<Dims> {
    let (b, nh, t, hd) = q.dims4()?;
    let (b2, nkv, tk, hd2) = k.dims4()?;
    if b2 != b || hd2 != hd || tk != (extra + 1) * t || nkv == 0 || nh % nkv != 0 || v != k {
        candle_core::bail!("ttt_attention: q {q:?}, k {k:?}, v {v:?} at step {extra}");
    }
    Ok(Dims { b, nh, nkv, t, hd })
}

/// Rows of `x` (`(b, nkv, rows, hd)` as a flat slice) for the later steps:
/// the `hd` values of kv unit `u`, key row `j * t + p`.
fn key_row<'a>(x: &'a [f32], d: &Dims, u: usize, j: usize, p: usize) -> &'a [f32] {
    let tk = x.len() / (d.b * d.nkv * d.hd);
    let o = (u * tk + j * d.t + p) * d.hd;
    &x[o..o + d.hd]
}

impl CustomOp3 for TttAttention {
    fn name(&self) -> &'static str {
        "ttt_attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = dims(self.extra, lq.shape(), lk.shape(), lv.shape())?;
        let (q, k, v) = (
            slice(sq, lq, "ttt_attention q")?,
            slice(sk, lk, "ttt_attention k")?,
            slice(sv, lv, "ttt_attention v")?,
        );
        let (g, t, hd, ex) = (d.g(), d.t, d.hd, self.extra);
        let dev = candle_core::Device::Cpu;
        let scale = 1.0 / (hd as f32).sqrt();
        let qg = Tensor::from_slice(q, (d.b, d.nkv, g * t, hd), &dev)?;
        let kt = Tensor::from_slice(k, (d.b, d.nkv, (ex + 1) * t, hd), &dev)?;
        let vt = Tensor::from_slice(v, (d.b, d.nkv, (ex + 1) * t, hd), &dev)?;
        let k0 = kt.narrow(2, 0, t)?.contiguous()?;
        let v0 = vt.narrow(2, 0, t)?.contiguous()?;
        // Scores of the step-0 keys, then masked softmax over them and the
        // row's later-step keys, in place.
        let s = qg.matmul(&k0.t()?)?;
        let mut sv_ = s.flatten_all()?.to_vec1::<f32>()?;
        // One column even at step 0, so the row chunks line up.
        let mut pe = vec![0f32; d.b * d.nh * t * ex.max(1)];
        sv_.par_chunks_mut(t)
            .zip(pe.par_chunks_mut(ex.max(1)))
            .enumerate()
            .for_each_init(Vec::new, |se: &mut Vec<f32>, (r, (srow, perow))| {
                let p = r % t;
                let u = r / (g * t);
                let qr = &q[r * hd..(r + 1) * hd];
                se.clear();
                se.extend((1..=ex).map(|j| dot(qr, key_row(k, &d, u, j, p)) * scale));
                let m = srow[..=p]
                    .iter()
                    .map(|&x| x * scale)
                    .chain(se.iter().copied())
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in srow[..=p].iter_mut() {
                    *x = exp_f32(*x * scale - m);
                    sum += *x;
                }
                for x in se.iter_mut() {
                    *x = exp_f32(*x - m);
                    sum += *x;
                }
                let inv = 1.0 / sum;
                srow[..=p].iter_mut().for_each(|x| *x *= inv);
                srow[p + 1..].iter_mut().for_each(|x| *x = 0.0);
                for (o, x) in perow.iter_mut().zip(se.iter()) {
                    *o = x * inv;
                }
            });
        let p = Tensor::from_vec(sv_, (d.b, d.nkv, g * t, t), &dev)?;
        let mut o = p.matmul(&v0)?.flatten_all()?.to_vec1::<f32>()?;
        if ex > 0 {
            o.par_chunks_mut(hd).enumerate().for_each(|(r, orow)| {
                let (p_, u) = (r % t, r / (g * t));
                for j in 1..=ex {
                    axpy(orow, pe[r * ex.max(1) + j - 1], key_row(v, &d, u, j, p_));
                }
            });
        }
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(Saved { p, pe });
        Ok((CpuStorage::F32(o), lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = dims(self.extra, q.shape(), k.shape(), v.shape())?;
        let (g, t, hd, ex) = (d.g(), d.t, d.hd, self.extra);
        let tk = (ex + 1) * t;
        let scale = 1.0 / (hd as f32).sqrt();
        let Some(Saved { p, pe }) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            candle_core::bail!("ttt_attention: backward before forward (or twice)");
        };
        let flat = |x: &Tensor| x.contiguous()?.flatten_all()?.to_vec1::<f32>();
        let (qv, kv, vv, ov) = (flat(q)?, flat(k)?, flat(v)?, flat(res)?);
        let go = grad_res.contiguous()?.reshape((d.b, d.nkv, g * t, hd))?;
        let gov = go.flatten_all()?.to_vec1::<f32>()?;
        let k0 = k.narrow(2, 0, t)?.contiguous()?;
        let v0 = v.narrow(2, 0, t)?.contiguous()?;
        let qg = q.contiguous()?.reshape((d.b, d.nkv, g * t, hd))?;
        // dP = dO V0^T, then dS = P (dP - D) on the step-0 keys and the
        // later-step keys alike (D = dO . O per row).
        let mut ds = go.matmul(&v0.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let pv = p.flatten_all()?.to_vec1::<f32>()?;
        let mut dse = vec![0f32; pe.len()];
        ds.par_chunks_mut(t)
            .zip(pv.par_chunks(t))
            .zip(dse.par_chunks_mut(ex.max(1)))
            .enumerate()
            .for_each(|(r, ((dsrow, prow), dserow))| {
                let (p_, u) = (r % t, r / (g * t));
                let row = r * hd..(r + 1) * hd;
                let gr = &gov[row.clone()];
                let dsum = dot(gr, &ov[row]);
                for (x, &a) in dsrow[..=p_].iter_mut().zip(prow) {
                    *x = a * (*x - dsum) * scale;
                }
                dsrow[p_ + 1..].iter_mut().for_each(|x| *x = 0.0);
                for j in 1..=ex {
                    let a = pe[r * ex.max(1) + j - 1];
                    dserow[j - 1] = a * (dot(gr, key_row(&vv, &d, u, j, p_)) - dsum) * scale;
                }
            });
        let ds = Tensor::from_vec(ds, (d.b, d.nkv, g * t, t), &candle_core::Device::Cpu)?;
        let mut dq = ds.matmul(&k0)?.flatten_all()?.to_vec1::<f32>()?;
        let dk0 = ds.t()?.matmul(&qg)?.flatten_all()?.to_vec1::<f32>()?;
        let dv0 = p.t()?.matmul(&go)?.flatten_all()?.to_vec1::<f32>()?;
        // The later steps' keys: row p of step j is read by row p of every
        // query head of its group.
        let mut dk = vec![0f32; kv.len()];
        let mut dv = vec![0f32; vv.len()];
        dk.par_chunks_mut(tk * hd)
            .zip(dv.par_chunks_mut(tk * hd))
            .zip(dq.par_chunks_mut(g * t * hd))
            .enumerate()
            .for_each(|(u, ((dku, dvu), dqu))| {
                let src = u * t * hd..(u + 1) * t * hd;
                dku[..t * hd].copy_from_slice(&dk0[src.clone()]);
                dvu[..t * hd].copy_from_slice(&dv0[src]);
                for gi in 0..g {
                    for p_ in 0..t {
                        let r = (u * g + gi) * t + p_;
                        let lr = (gi * t + p_) * hd;
                        let row = r * hd..(r + 1) * hd;
                        for j in 1..=ex {
                            let at = (j * t + p_) * hd;
                            let (a, s_) = (pe[r * ex.max(1) + j - 1], dse[r * ex.max(1) + j - 1]);
                            axpy(&mut dqu[lr..lr + hd], s_, key_row(&kv, &d, u, j, p_));
                            axpy(&mut dku[at..at + hd], s_, &qv[row.clone()]);
                            axpy(&mut dvu[at..at + hd], a, &gov[row.clone()]);
                        }
                    }
                }
            });
        let dev = candle_core::Device::Cpu;
        Ok((
            Some(Tensor::from_vec(dq, (d.b, d.nh, t, hd), &dev)?),
            Some(Tensor::from_vec(dk, (d.b, d.nkv, tk, hd), &dev)?),
            Some(Tensor::from_vec(dv, (d.b, d.nkv, tk, hd), &dev)?),
        ))
    }
}

/// RMS norm over the last dimension, `x / sqrt(mean(x^2) + eps) * w`,
/// with gradients for `x` and the weight `w`.
pub(super) struct RmsNorm {
    pub(super) eps: f32,
}

impl RmsNorm {
    /// Per row `1 / sqrt(mean(x^2) + eps)`.
    fn inv(&self, x: &[f32], n: usize) -> Vec<f32> {
        x.par_chunks(n)
            .map(|r| 1.0 / (dot(r, r) / n as f32 + self.eps).sqrt())
            .collect()
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (slice(sx, lx, "rms_norm x")?, slice(sw, lw, "rms_norm w")?);
        let n = w.len();
        if n == 0 || lx.shape().dims().last() != Some(&n) {
            candle_core::bail!("rms_norm: x {:?}, w {:?}", lx.shape(), lw.shape());
        }
        let inv = self.inv(x, n);
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(n)
            .zip(x.par_chunks(n).zip(inv.par_iter()))
            .for_each(|(o, (xr, &s))| {
                for ((o, &x), &w) in o.iter_mut().zip(xr).zip(w) {
                    *o = x * s * w;
                }
            });
        Ok((CpuStorage::F32(out), lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let flat = |t: &Tensor| t.contiguous()?.flatten_all()?.to_vec1::<f32>();
        let (xv, wv, gv) = (flat(x)?, flat(w)?, flat(grad_res)?);
        let n = wv.len();
        let inv = self.inv(&xv, n);
        let mut dx = vec![0f32; xv.len()];
        // dx = s (w g - x s^2 (sum_j w_j g_j x_j) / n); dw = sum_rows g x s.
        let dw = dx
            .par_chunks_mut(n)
            .zip(xv.par_chunks(n).zip(gv.par_chunks(n)))
            .zip(inv.par_iter())
            .fold(
                || vec![0f32; n],
                |mut dw, ((dxr, (xr, gr)), &s)| {
                    let mut c = 0f32;
                    for ((&x, &g), &w) in xr.iter().zip(gr).zip(&wv) {
                        c += w * g * x;
                    }
                    let c = c * s * s / n as f32;
                    for (((d, &x), &g), (&w, dwi)) in dxr
                        .iter_mut()
                        .zip(xr)
                        .zip(gr)
                        .zip(wv.iter().zip(dw.iter_mut()))
                    {
                        *d = s * (w * g - x * c);
                        *dwi += g * x * s;
                    }
                    dw
                },
            )
            .reduce(
                || vec![0f32; n],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        let dev = candle_core::Device::Cpu;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), &dev)?),
            Some(Tensor::from_vec(dw, w.shape(), &dev)?),
        ))
    }
}

/// Rotary position embedding of `(b, heads, t, hd)` rows at positions
/// `offset..offset + t`, NeoX pairing (`i` with `i + hd/2`, as Hugging
/// Face Llama); `cos`/`sin` are `(positions, hd/2)` tables.
pub(super) struct Rope {
    pub(super) cos: Arc<Vec<f32>>,
    pub(super) sin: Arc<Vec<f32>>,
    pub(super) offset: usize,
    /// Per-row positions instead (`b * t` of them, shared by the heads):
    /// rows at positions of their own (DFlash's blocks).
    pub(super) pos: Option<Arc<Vec<u32>>>,
}

impl Rope {
    /// `x` rotated by the angle of each row's position, or back (`sign`
    /// -1: the transpose, which is the backward pass).
    fn rotate(&self, x: &[f32], (n, t, hd): (usize, usize, usize), sign: f32) -> Result<Vec<f32>> {
        let half = hd / 2;
        let last = match &self.pos {
            Some(p) => {
                if p.len() * n * hd != x.len() {
                    candle_core::bail!("rope: {} positions for {} rows", p.len(), x.len() / hd);
                }
                p.iter().map(|&q| q as usize + 1).max().unwrap_or(0)
            }
            None => self.offset + t,
        };
        if !hd.is_multiple_of(2) || last * half > self.cos.len() {
            candle_core::bail!("rope: head dim {hd}, positions {last}");
        }
        let at = |r: usize| match &self.pos {
            Some(p) => p[(r / (n * t)) * t + r % t] as usize * half,
            None => (self.offset + r % t) * half,
        };
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(hd)
            .zip(x.par_chunks(hd))
            .enumerate()
            .for_each(|(r, (o, xr))| {
                let at = at(r);
                let (c, s) = (&self.cos[at..at + half], &self.sin[at..at + half]);
                let (o1, o2) = o.split_at_mut(half);
                let (x1, x2) = xr.split_at(half);
                for i in 0..half {
                    let si = sign * s[i];
                    o1[i] = x1[i] * c[i] - x2[i] * si;
                    o2[i] = x2[i] * c[i] + x1[i] * si;
                }
            });
        Ok(out)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = slice(s, l, "rope")?;
        let (_, n, t, hd) = l.shape().dims4()?;
        Ok((
            CpuStorage::F32(self.rotate(x, (n, t, hd), 1.0)?),
            l.shape().clone(),
        ))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (_, n, t, hd) = x.dims4()?;
        let g = grad_res.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let dx = self.rotate(&g, (n, t, hd), -1.0)?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::sampler::Rng::new(seed);
        (0..n).map(|_| (r.next_f64() as f32 - 0.5) * 2.0).collect()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let (a, b) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= tol * scale, "element {i}: {x} vs {y}");
        }
    }

    /// The gradients of `sum(o * wl)` for `vars` through `got` are within
    /// `tol` of those through `want`.
    fn same_grads(want: &Tensor, got: &Tensor, wl: &Tensor, vars: &[&Var], tol: f32) {
        let loss = |o: &Tensor| (o * wl).unwrap().sum_all().unwrap();
        let (gw, gg) = (
            loss(want).backward().unwrap(),
            loss(got).backward().unwrap(),
        );
        for v in vars {
            close(
                gg.get(v.as_tensor()).unwrap(),
                gw.get(v.as_tensor()).unwrap(),
                tol,
            );
        }
    }

    #[test]
    fn soft_cross_entropy_matches_its_composition_and_gradient() {
        let dev = Device::Cpu;
        let (rows, n) = (6, 37);
        let logits = Var::from_vec(rand(rows * n, 1), (rows, n), &dev).unwrap();
        let target = (Tensor::from_vec(rand(rows * n, 2), (rows, n), &dev).unwrap() * 3.0).unwrap();
        let w = vec![0.5, 0.0, 1.0, 0.25, 0.0, 2.0];
        let wt = Tensor::from_slice(&w, rows, &dev).unwrap();
        // The composition the trainer used before.
        let p = candle_nn::ops::softmax_last_dim(&target).unwrap();
        let logp = candle_nn::ops::log_softmax(logits.as_tensor(), D::Minus1).unwrap();
        let want = ((p * logp).unwrap().sum(D::Minus1).unwrap() * &wt)
            .unwrap()
            .sum_all()
            .unwrap()
            .neg()
            .unwrap();
        let got = logits
            .as_tensor()
            .apply_op2(&target, SoftCrossEntropy::new(w))
            .unwrap();
        close(&got, &want, 1e-5);
        let (gw, gg) = (
            (want * 1.7).unwrap().backward().unwrap(),
            (got * 1.7).unwrap().backward().unwrap(),
        );
        let (a, b) = (
            gg.get(logits.as_tensor()).unwrap(),
            gw.get(logits.as_tensor()).unwrap(),
        );
        close(a, b, 1e-5);
        // Rows of weight 0 get no gradient, the others do.
        let a = a.to_vec2::<f32>().unwrap();
        assert!(a[1].iter().all(|&x| x == 0.0) && a[0].iter().any(|&x| x != 0.0));
    }

    /// The TTT attention composed from candle ops (the trainer's probe
    /// path), over the concatenated keys the fused op reads.
    fn composed(q: &Tensor, k: &Tensor, v: &Tensor, nh: usize, extra: usize) -> Tensor {
        let t = q.dim(2).unwrap();
        let keys: Vec<(Tensor, Tensor)> = (0..=extra)
            .map(|j| {
                (
                    k.narrow(2, j * t, t).unwrap(),
                    v.narrow(2, j * t, t).unwrap(),
                )
            })
            .collect();
        let scale = 1.0 / (q.dim(3).unwrap() as f64).sqrt();
        crate::distill::eagle::composed_attention(q, &keys, nh, scale)
            .unwrap()
            .0
    }

    #[test]
    fn ttt_attention_matches_its_composition_and_gradients_at_every_step() {
        let dev = Device::Cpu;
        let (b, nh, nkv, t, hd) = (2, 6, 2, 5, 16);
        for extra in 0..3 {
            let tk = (extra + 1) * t;
            let q = Var::from_vec(rand(b * nh * t * hd, 3), (b, nh, t, hd), &dev).unwrap();
            let k = Var::from_vec(rand(b * nkv * tk * hd, 4), (b, nkv, tk, hd), &dev).unwrap();
            let v = Var::from_vec(rand(b * nkv * tk * hd, 5), (b, nkv, tk, hd), &dev).unwrap();
            let want = composed(q.as_tensor(), k.as_tensor(), v.as_tensor(), nh, extra);
            let got = q
                .as_tensor()
                .apply_op3(k.as_tensor(), v.as_tensor(), TttAttention::new(extra))
                .unwrap();
            close(&got, &want, 1e-5);
            // A loss that weighs every output element differently.
            let wl = Tensor::from_vec(rand(b * nh * t * hd, 6), (b, nh, t, hd), &dev).unwrap();
            let loss = |o: &Tensor| (o * &wl).unwrap().sum_all().unwrap();
            let (gw, gg) = (
                loss(&want).backward().unwrap(),
                loss(&got).backward().unwrap(),
            );
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let (a, b) = (gg.get(x.as_tensor()), gw.get(x.as_tensor()));
                assert!(
                    a.is_some() && b.is_some(),
                    "step {extra}: no gradient of {name} ({} {})",
                    a.is_some(),
                    b.is_some()
                );
                close(a.unwrap(), b.unwrap(), 1e-4);
            }
        }
    }

    #[test]
    fn bf16_matmul_matches_f32_and_its_gradients() {
        if !crate::model::kernels::bf16::available() {
            eprintln!("SKIPPED bf16_matmul_matches_f32_and_its_gradients: no AMX-BF16 here");
            return;
        }
        let dev = Device::Cpu;
        // Off every tile edge (33 rows, 70 inputs, 19 outputs).
        let x = Var::from_vec(rand(33 * 70, 11), (33, 70), &dev).unwrap();
        let w = Var::from_vec(rand(19 * 70, 12), (19, 70), &dev).unwrap();
        let want = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let got = x.as_tensor().apply_op2(w.as_tensor(), MatmulWt).unwrap();
        // bf16 inputs: 8 significant bits, so about 2^-8 of the largest
        // term per element; sums of 70 terms of both signs.
        close(&got, &want, 2e-2);
        let wl = Tensor::from_vec(rand(33 * 19, 13), (33, 19), &dev).unwrap();
        same_grads(&want, &got, &wl, &[&x, &w], 2e-2);
        // The tolerance tells a bf16 product from a wrong one: dropping
        // the last input column is already far outside it.
        let short = x
            .as_tensor()
            .narrow(1, 0, 69)
            .unwrap()
            .matmul(&w.as_tensor().narrow(1, 0, 69).unwrap().t().unwrap())
            .unwrap();
        let worst = |a: &Tensor| {
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            a.iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale
        };
        assert!(worst(&short) > 2e-2 && worst(&got) < 2e-2 && worst(&got) > 0.0);
    }

    #[test]
    fn rms_norm_matches_its_composition_and_gradients() {
        let dev = Device::Cpu;
        let x = Var::from_vec(rand(3 * 4 * 40, 7), (3, 4, 40), &dev).unwrap();
        let w = Var::from_vec(rand(40, 8), 40, &dev).unwrap();
        let xt = x.as_tensor();
        let ms = xt.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let want = xt
            .broadcast_div(&(ms + 1e-5).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(w.as_tensor())
            .unwrap();
        let got = xt.apply_op2(w.as_tensor(), RmsNorm { eps: 1e-5 }).unwrap();
        close(&got, &want, 1e-5);
        let wl = Tensor::from_vec(rand(3 * 4 * 40, 9), (3, 4, 40), &dev).unwrap();
        same_grads(&want, &got, &wl, &[&x, &w], 1e-4);
    }

    #[test]
    fn rope_matches_its_composition_and_gradient() {
        let dev = Device::Cpu;
        let (b, n, t, hd, offset) = (2, 3, 5, 8, 2);
        let x = Var::from_vec(rand(b * n * t * hd, 10), (b, n, t, hd), &dev).unwrap();
        let ang: Vec<f32> = (0..offset + t)
            .flat_map(|p| (0..hd / 2).map(move |i| p as f32 * 0.3f32.powi(i as i32)))
            .collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = ang.iter().map(|a| (a.cos(), a.sin())).unzip();
        // The composition: x * cos + rotate_half(x) * sin, tables with both
        // halves.
        let full = |v: &[f32]| {
            let t2 = Tensor::from_slice(v, (offset + t, hd / 2), &dev).unwrap();
            Tensor::cat(&[&t2, &t2], 1)
                .unwrap()
                .narrow(0, offset, t)
                .unwrap()
        };
        let xt = x.as_tensor();
        let x1 = xt.narrow(D::Minus1, 0, hd / 2).unwrap();
        let x2 = xt.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
        let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
        let want = (xt.broadcast_mul(&full(&cos)).unwrap()
            + rot.broadcast_mul(&full(&sin)).unwrap())
        .unwrap();
        let got = xt
            .apply_op1(Rope {
                cos: Arc::new(cos.clone()),
                sin: Arc::new(sin.clone()),
                offset,
                pos: None,
            })
            .unwrap();
        close(&got, &want, 1e-6);
        // Per-row positions: batch 0 at offset.., batch 1 at 0.. (each as
        // a run with that offset alone).
        let pos: Vec<u32> = (0..t)
            .map(|p| (offset + p) as u32)
            .chain((0..t).map(|p| p as u32))
            .collect();
        let at = |off: usize, pos: Option<Vec<u32>>, x: &Tensor| {
            x.contiguous()
                .unwrap()
                .apply_op1(Rope {
                    cos: Arc::new(cos.clone()),
                    sin: Arc::new(sin.clone()),
                    offset: off,
                    pos: pos.map(Arc::new),
                })
                .unwrap()
        };
        let rows = at(0, Some(pos), xt);
        close(
            &rows.narrow(0, 0, 1).unwrap(),
            &want.narrow(0, 0, 1).unwrap(),
            1e-6,
        );
        let b1 = xt.narrow(0, 1, 1).unwrap();
        close(&rows.narrow(0, 1, 1).unwrap(), &at(0, None, &b1), 1e-6);
        let wl = Tensor::from_vec(rand(b * n * t * hd, 11), (b, n, t, hd), &dev).unwrap();
        let loss = |o: &Tensor| (o * &wl).unwrap().sum_all().unwrap();
        let (gw, gg) = (
            loss(&want).backward().unwrap(),
            loss(&got).backward().unwrap(),
        );
        close(gg.get(xt).unwrap(), gw.get(xt).unwrap(), 1e-5);
    }
}

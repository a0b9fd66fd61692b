//! The generated C ABI: generic `extern "C"` functions instantiated for the
//! exported proposer type. Every function catches panics.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::abi::{
    self, Capabilities, Descriptor, DraftOut, HostApi, Instance, ObserveInput, SeqInput, Status,
    Str, VTable,
};
use crate::{Host, Options, Plugin, Proposal, SeqView, Q};

struct Inst<T> {
    proposer: T,
    last_error: String,
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}

/// Run `f` on the instance, turning errors and panics into a status.
fn guard<T: Plugin>(inst: Instance, f: impl FnOnce(&mut T) -> Result<(), String>) -> Status {
    if inst.is_null() {
        return abi::STATUS_ERROR;
    }
    // SAFETY: `inst` was produced by `create::<T>` (a leaked `Box<Inst<T>>`)
    // and the host never uses it after `destroy` or from two threads at once.
    let inst = unsafe { &mut *(inst as *mut Inst<T>) };
    match catch_unwind(AssertUnwindSafe(|| f(&mut inst.proposer))) {
        Ok(Ok(())) => abi::STATUS_OK,
        Ok(Err(e)) => {
            inst.last_error = e;
            abi::STATUS_ERROR
        }
        Err(p) => {
            inst.last_error = panic_message(p);
            abi::STATUS_PANIC
        }
    }
}

/// # Safety
/// `s` must point to `len` valid UTF-8 bytes (or be empty).
unsafe fn str_of<'a>(s: Str) -> &'a str {
    if s.ptr.is_null() || s.len == 0 {
        return "";
    }
    // SAFETY: guaranteed by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
    std::str::from_utf8(bytes).unwrap_or("")
}

/// # Safety
/// `p` must point to `n` readable elements (or `n` must be 0).
unsafe fn slice<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if p.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

/// # Safety
/// Called by the host through the vtable with valid pointers.
pub unsafe extern "C" fn create<T: Plugin>(
    config: Str,
    host: *const HostApi,
    out: *mut Instance,
    err: *mut u8,
    err_cap: usize,
    written: *mut usize,
) -> Status {
    let result = catch_unwind(AssertUnwindSafe(|| {
        if host.is_null() || out.is_null() {
            return Err("null host or output pointer".to_string());
        }
        // SAFETY: the host passes a valid, size-prefixed API table and UTF-8
        // config text; fields this SDK knows but the host did not send read
        // as zero (`None` callbacks).
        let (api, text) = unsafe { (abi::read_sized(host), str_of(config)) };
        let api = api.ok_or("the host passed an empty API table")?;
        let opts = Options::parse(text)?;
        // SAFETY: the host keeps its API table valid for the instance's life.
        let host = unsafe { Host::from_abi(api) };
        T::create(&opts, host)
    }));
    let msg = match result {
        Ok(Ok(p)) => {
            let inst = Box::new(Inst {
                proposer: p,
                last_error: String::new(),
            });
            // SAFETY: `out` checked non-null above; the host owns the pointer
            // until it calls `destroy`.
            unsafe { *out = Box::into_raw(inst) as *mut c_void };
            return abi::STATUS_OK;
        }
        Ok(Err(e)) => e,
        Err(p) => panic_message(p),
    };
    if !err.is_null() && !written.is_null() {
        let n = msg.len().min(err_cap);
        // SAFETY: the host passed a buffer of `err_cap` bytes and a valid
        // `written` pointer.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), err, n);
            *written = n;
        }
    }
    abi::STATUS_ERROR
}

/// # Safety
/// `inst` must come from `create::<T>` and not be used afterwards.
pub unsafe extern "C" fn destroy<T: Plugin>(inst: Instance) {
    if !inst.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: see the function contract.
            drop(unsafe { Box::from_raw(inst as *mut Inst<T>) });
        }));
    }
}

/// # Safety
/// Valid instance and output pointer.
pub unsafe extern "C" fn capabilities<T: Plugin>(inst: Instance, out: *mut Capabilities) -> Status {
    guard::<T>(inst, |p| {
        if out.is_null() {
            return Err("null output".into());
        }
        // SAFETY: checked non-null; the host passes a writable struct of its
        // own `struct_size`; we write at most that many bytes.
        unsafe {
            let room = (out as *const u32).read_unaligned() as usize;
            let caps = p.capabilities().to_abi();
            let n = room.min(std::mem::size_of::<Capabilities>());
            std::ptr::copy_nonoverlapping(
                &caps as *const Capabilities as *const u8,
                out as *mut u8,
                n,
            );
            // Report what was written (the smaller of the two sizes).
            (out as *mut u32).write_unaligned(n as u32);
        }
        Ok(())
    })
}

/// # Safety
/// Valid instance; `tokens` points to `n` tokens.
pub unsafe extern "C" fn start<T: Plugin>(
    inst: Instance,
    seq: u64,
    tokens: *const u32,
    n: usize,
) -> Status {
    // SAFETY: guaranteed by the host.
    let t = unsafe { slice(tokens, n) };
    guard::<T>(inst, |p| p.start(seq, t))
}

/// # Safety
/// Valid instance; `input` points to a valid, size-prefixed observation.
pub unsafe extern "C" fn observe<T: Plugin>(inst: Instance, input: *const ObserveInput) -> Status {
    // SAFETY: guaranteed by the host.
    let Some(o) = (unsafe { abi::read_sized(input) }) else {
        return abi::STATUS_ERROR;
    };
    // SAFETY: the host's buffers hold `n_tokens` tokens and `n_path` indices.
    let (t, path) = unsafe { (slice(o.tokens, o.n_tokens), slice(o.path, o.n_path)) };
    guard::<T>(inst, |p| p.observe(o.seq, t, path))
}

/// # Safety
/// Valid instance.
pub unsafe extern "C" fn finish<T: Plugin>(inst: Instance, seq: u64) -> Status {
    guard::<T>(inst, |p| {
        p.finish(seq);
        Ok(())
    })
}

/// # Safety
/// Valid instance; `buf` has `cap` writable bytes.
pub unsafe extern "C" fn last_error<T: Plugin>(inst: Instance, buf: *mut u8, cap: usize) -> usize {
    if inst.is_null() {
        return 0;
    }
    // SAFETY: see `guard`.
    let inst = unsafe { &*(inst as *const Inst<T>) };
    let msg = inst.last_error.as_bytes();
    if !buf.is_null() {
        // SAFETY: the host passed `cap` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), buf, msg.len().min(cap)) };
    }
    msg.len()
}

/// # Safety
/// Valid instance; `seqs` points to `n_seqs` pointers to size-prefixed
/// inputs whose buffers are valid; `out` is a host-allocated output sized
/// as its fields say.
pub unsafe extern "C" fn propose<T: Plugin>(
    inst: Instance,
    seqs: *const *const SeqInput,
    n_seqs: usize,
    out: *mut DraftOut,
) -> Status {
    // SAFETY: guaranteed by the host.
    let (ptrs, out) = unsafe { (slice(seqs, n_seqs), abi::read_sized(out)) };
    let Some(out) = out else {
        return abi::STATUS_ERROR;
    };
    let mut views: Vec<SeqView<'_>> = Vec::with_capacity(ptrs.len());
    for &p in ptrs {
        // SAFETY: the host passes valid, size-prefixed inputs.
        let Some(s) = (unsafe { abi::read_sized(p) }) else {
            return abi::STATUS_ERROR;
        };
        let (width, rows, layers) = (
            s.hidden_width as usize,
            s.n_hidden_rows as usize,
            s.n_hidden_layers as usize,
        );
        views.push(SeqView {
            seq: s.seq,
            // SAFETY: the host passes valid token and hidden buffers.
            tokens: unsafe { slice(s.tokens, s.n_tokens) },
            max_draft: (s.max_draft as usize).min(out.draft_cap as usize),
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed: s.seed,
            // SAFETY: as above; `layers * rows * width` floats.
            hidden: unsafe { slice(s.hidden, layers * rows * width) },
            hidden_rows: rows,
            hidden_width: width,
            hidden_layers: layers,
            hidden_start: s.hidden_start,
        });
    }
    guard::<T>(inst, |p| {
        let drafts = p.propose(&views)?;
        if drafts.len() != views.len() {
            return Err(format!(
                "propose returned {} drafts for {} sequences",
                drafts.len(),
                views.len()
            ));
        }
        for (i, (d, v)) in drafts.iter().zip(&views).enumerate() {
            write_draft(&out, i, d, v.max_draft)?;
        }
        Ok(())
    })
}

fn write_draft(out: &DraftOut, i: usize, d: &Proposal, max_draft: usize) -> Result<(), String> {
    let cap = out.draft_cap as usize;
    let qcap = out.q_cap as usize;
    let n = d.tokens.len().min(max_draft).min(cap);
    if let Some(p) = &d.parents {
        if p.len() < n {
            return Err(format!("{} parents for {} draft tokens", p.len(), n));
        }
    }
    // SAFETY: for all writes below, the host allocated `n_seqs` counters,
    // `n_seqs * draft_cap` tokens, parents and q lengths, and
    // `n_seqs * draft_cap * q_cap` q entries; `i < n_seqs`, `j < n <= cap`.
    unsafe {
        *out.n_drafted.add(i) = n as u32;
        for j in 0..n {
            let slot = i * cap + j;
            *out.tokens.add(slot) = d.tokens[j];
            if !out.parents.is_null() {
                let parent = d
                    .parents
                    .as_ref()
                    .and_then(|p| p.get(j).copied())
                    .unwrap_or(j as i32 - 1);
                *out.parents.add(slot) = parent;
            }
            if qcap == 0 || out.q_probs.is_null() {
                continue;
            }
            let base = slot * qcap;
            let mut len = 0usize;
            match d.q.get(j) {
                Some(Q::Sparse(pairs)) => {
                    for (k, &(id, pr)) in pairs.iter().take(qcap).enumerate() {
                        if !out.q_ids.is_null() {
                            *out.q_ids.add(base + k) = id;
                        }
                        *out.q_probs.add(base + k) = pr;
                        len = k + 1;
                    }
                }
                Some(Q::Full(v)) => {
                    if v.len() != qcap {
                        return Err(format!(
                            "full q of {} entries for a vocabulary of {qcap}",
                            v.len()
                        ));
                    }
                    std::ptr::copy_nonoverlapping(v.as_ptr(), out.q_probs.add(base), qcap);
                    len = qcap;
                }
                Some(Q::OneHot) | Some(Q::AsFirstSibling) | None => {}
            }
            if !out.q_len.is_null() {
                *out.q_len.add(slot) = len as u32;
            }
        }
    }
    Ok(())
}

/// The descriptor for `T` (its capabilities and vtable live as long as
/// the library).
pub fn descriptor<T: Plugin>() -> Descriptor {
    let build_id: &'static str = Box::leak(
        format!(
            "{}-{}-abi{}.{}",
            T::NAME,
            T::VERSION,
            abi::ABI_MAJOR,
            abi::ABI_MINOR
        )
        .into_boxed_str(),
    );
    let caps: &'static Capabilities = Box::leak(Box::new(T::default_capabilities().to_abi()));
    let vtable: &'static VTable = Box::leak(Box::new(VTable {
        struct_size: abi::size_of::<VTable>(),
        create: Some(create::<T>),
        destroy: Some(destroy::<T>),
        capabilities: Some(capabilities::<T>),
        start: Some(start::<T>),
        propose: Some(propose::<T>),
        observe: Some(observe::<T>),
        finish: Some(finish::<T>),
        last_error: Some(last_error::<T>),
    }));
    Descriptor {
        abi_major: abi::ABI_MAJOR,
        abi_minor: abi::ABI_MINOR,
        struct_size: abi::size_of::<Descriptor>(),
        name: Str::from_static(T::NAME),
        version: Str::from_static(T::VERSION),
        build_id: Str::from_static(build_id),
        caps,
        vtable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_name_key_and_type() {
        let o = Options::parse("max_n = \"three\"\nmin_n = 2\nratio = 1.5\n").unwrap();
        let err = o.get::<usize>("max_n", 3).unwrap_err();
        assert!(
            err.contains("`max_n`") && err.contains("expected an integer"),
            "{err}"
        );
        assert_eq!(o.get::<usize>("min_n", 1).unwrap(), 2);
        assert_eq!(o.get::<f64>("ratio", 1.0).unwrap(), 1.5);
        assert!(o.get::<bool>("absent", true).unwrap());
        let err = o.reject_unknown(&["min_n", "max_n"]).unwrap_err();
        assert!(err.contains("unknown option `ratio`"), "{err}");
        assert!(Options::parse("= broken")
            .unwrap_err()
            .contains("not valid TOML"));
    }
}

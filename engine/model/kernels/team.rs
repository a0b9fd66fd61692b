//! A forward's own fork-join executor: the thread running a forward (the
//! leader) and the pool's other threads (its helpers) share each parallel
//! section's tasks through one atomic word.
//!
//! A decode or verify forward of the default model has about 150 parallel
//! sections (four products and an attention a layer, the LM head) of 2-20
//! µs each. Through rayon each section is split by `join` and stolen piece
//! by piece, which cost 1-3 µs more a section than a task counter both
//! threads claim from (measured with the same spinning helper); here a
//! section is published by storing one word, and every thread claims runs
//! of tasks with one compare-and-swap each until none are left.
//!
//! *Invariants:*
//! - A section's closure lives on the leader's stack; `run` returns only
//!   when every task it published has finished (`done == n`), and a helper
//!   reads the closure only after claiming a task of the section that is
//!   current at its claim (the claim and the section are one word), so no
//!   helper ever calls a closure whose section has returned.
//! - Which thread runs a task never changes what it computes: sections are
//!   lists of independent tasks writing disjoint outputs, as with rayon.
//! - A task's panic is caught where it ran and re-raised by the leader
//!   after the section's other tasks have finished.
//! - Outside a team (no forward running on this thread, or one thread)
//!   sections run through rayon as before; rayon jobs a leader spawns
//!   itself are taken by idle helpers too.

use rayon::prelude::*;
use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bits of the state word holding each end of the unclaimed tasks; the
/// rest count sections.
const TASK_BITS: u32 = 20;
const TASK_MASK: u64 = (1 << TASK_BITS) - 1;
/// Sections longer than this run through rayon (none in a forward: the
/// largest, a prefill chunk's LM head or attention, has a few thousand).
const MAX_TASKS: usize = TASK_MASK as usize;

/// How long a helper spins without a task before it parks until the next
/// section (a long serial stretch of the leader; parking and waking cost
/// tens of microseconds, so the common gaps of a few are spun through).
const SPIN_IDLE: Duration = Duration::from_micros(500);

type Task<'a> = &'a (dyn Fn(usize) + Sync + 'a);

/// The state word: section count, the first unclaimed task (`lo`) and one
/// past the last (`hi`); tasks `lo..hi` are left to claim.
fn pack(epoch: u64, lo: usize, hi: usize) -> u64 {
    (epoch << (2 * TASK_BITS)) | ((lo as u64) << TASK_BITS) | hi as u64
}

fn unpack(s: u64) -> (u64, usize, usize) {
    (
        s >> (2 * TASK_BITS),
        ((s >> TASK_BITS) & TASK_MASK) as usize,
        (s & TASK_MASK) as usize,
    )
}

/// The shared state of one forward's threads.
pub struct Team {
    /// Section count and the unclaimed tasks of the current section
    /// (`pack`).
    state: AtomicU64,
    /// The current section's closure: a pointer to a `Task` on the leader's
    /// stack, valid while that section has unfinished tasks.
    job: AtomicPtr<()>,
    /// Tasks of the current section finished (by any thread).
    done: AtomicUsize,
    /// Whether the current section's tasks are claimed one at a time
    /// (tasks of very different costs) rather than `1 / (2 * threads)` of
    /// what is left.
    single: AtomicBool,
    /// The first panic of the current section's tasks.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Set when the forward is over: helpers return.
    quit: AtomicBool,
    /// The leader and its helpers: a claim takes `1 / (2 * threads)` of
    /// what is left.
    threads: usize,
    /// Parked helpers, woken by the next section or by `finish`.
    parked: Mutex<Vec<std::thread::Thread>>,
    parked_count: AtomicUsize,
}

thread_local! {
    /// The team this thread leads, while it runs a forward (null inside a
    /// section's tasks).
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Whether this thread is running `Team::help`.
    static HELPING: Cell<bool> = const { Cell::new(false) };
}

/// Sets `LEADING` until dropped, then restores what it held (also when
/// unwinding).
struct Leading(*const Team);

impl Leading {
    fn set(team: *const Team) -> Self {
        Self(LEADING.with(|l| l.replace(team)))
    }
}

impl Drop for Leading {
    fn drop(&mut self) {
        LEADING.with(|l| l.set(self.0));
    }
}

impl Team {
    /// A team of `threads` threads (the leader and its helpers).
    pub fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            single: AtomicBool::new(false),
            panic: Mutex::new(None),
            quit: AtomicBool::new(false),
            parked: Mutex::new(Vec::new()),
            parked_count: AtomicUsize::new(0),
        }
    }

    /// Run `f` with this thread leading the team: its parallel sections
    /// (`for_each`, `map`) are shared with the threads running `help`.
    pub fn lead<R>(&self, f: impl FnOnce() -> R) -> R {
        let _leading = Leading::set(self);
        f()
    }

    /// End the forward: helpers return (parked ones are woken).
    pub fn finish(&self) {
        self.quit.store(true, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        if self.parked_count.load(Ordering::SeqCst) > 0 {
            for t in self.lock_parked().iter() {
                t.unpark();
            }
        }
    }

    fn lock_parked(&self) -> std::sync::MutexGuard<'_, Vec<std::thread::Thread>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claim and run some tasks of the current section, from its front
    /// (the leader) or its back (helpers); false when none is left to
    /// claim. The leader and a helper thus each walk a contiguous run of
    /// tasks (a product's weight rows in memory order) and meet where the
    /// work splits evenly. A claim takes `1 / (2 * threads)` of what is
    /// left (a quarter on two threads; at least one task; one in a `map`),
    /// so a section of many tiny tasks (the LM head's
    /// 768 for one row) costs a few claims, not one contended
    /// compare-and-swap a task, while its last tasks still balance.
    fn run_some(&self, front: bool) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (_, lo, hi) = unpack(s);
            if lo >= hi {
                return false;
            }
            // (A stale read of `single` only sizes the claim.)
            let take = if self.single.load(Ordering::Relaxed) {
                1
            } else {
                ((hi - lo) / (2 * self.threads)).max(1)
            };
            let (claimed, next) = if front {
                (lo..lo + take, s + ((take as u64) << TASK_BITS))
            } else {
                (hi - take..hi, s - take as u64)
            };
            match self
                .state
                .compare_exchange_weak(s, next, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => {
                    let p = self.job.load(Ordering::Acquire) as *const Task<'_>;
                    // SAFETY: the claim succeeded on the current state, so
                    // the tasks `claimed` belong to the section whose
                    // closure `job` points at (the leader writes `job`
                    // before publishing the state with Release, and our
                    // Acquire claim reads that state or a later claim of
                    // the same section). That section cannot return before
                    // these tasks count themselves done below, so the
                    // closure on the leader's stack is alive for the calls.
                    let f: Task<'_> = unsafe { *p };
                    let count = claimed.len();
                    for i in claimed {
                        if let Err(e) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                            let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                            slot.get_or_insert(e);
                        }
                    }
                    self.done.fetch_add(count, Ordering::AcqRel);
                    return true;
                }
                Err(now) => s = now,
            }
        }
    }

    /// Run tasks `0..n` of `f`, this thread (the leader) and the helpers
    /// claiming them; returns when all have finished.
    fn run(&self, n: usize, single: bool, f: &(dyn Fn(usize) + Sync)) {
        let task: Task<'_> = f;
        // A section inside one of this section's tasks on the leader would
        // overwrite this one's state: tasks see no team, so any parallel
        // work they start runs through rayon.
        let _no_team = Leading::set(std::ptr::null());
        self.done.store(0, Ordering::Relaxed);
        self.single.store(single, Ordering::Relaxed);
        self.job
            .store(&task as *const Task<'_> as *mut (), Ordering::Relaxed);
        let (epoch, _, _) = unpack(self.state.load(Ordering::Relaxed));
        let epoch = (epoch + 1) & ((1 << (64 - 2 * TASK_BITS)) - 1);
        self.state.store(pack(epoch, 0, n), Ordering::SeqCst);
        self.wake();
        while self.run_some(true) {}
        while self.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        let panic = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(e) = panic {
            resume_unwind(e);
        }
    }

    /// A helper's part of the forward: claim the sections' tasks as they
    /// come, spinning between them, parking after `SPIN_IDLE` without one,
    /// until `finish`.
    pub fn help(&self) {
        // A thread already helping (a task of this team that waits inside
        // rayon, which could hand it another queued helper job) returns at
        // once: that nested helper would spin until the forward ends while
        // the task below it never finishes.
        if HELPING.with(|h| h.replace(true)) {
            return;
        }
        struct Helping;
        impl Drop for Helping {
            fn drop(&mut self) {
                HELPING.with(|h| h.set(false));
            }
        }
        let _helping = Helping;
        let mut idle_since: Option<Instant> = None;
        let mut spins = 0u32;
        while !self.quit.load(Ordering::Acquire) {
            if self.run_some(false) {
                idle_since = None;
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                continue;
            }
            // Rayon work is helped too, less eagerly: the forward's own (a
            // plugin's `par_iter` inside its forward), or whatever else the
            // pool queued, which delays this forward's sections by no more
            // than the leader doing them alone.
            if let Some(rayon::Yield::Executed) = rayon::yield_now() {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < SPIN_IDLE {
                // Let another runnable thread on this core (more threads
                // than cores, or the engine's own) go first.
                std::thread::yield_now();
                continue;
            }
            // Park until the next section or the end: registered before
            // the state is read again, so a section published in between
            // either is seen here or sees this helper parked (both sides
            // SeqCst).
            let me = std::thread::current();
            self.lock_parked().push(me.clone());
            self.parked_count.fetch_add(1, Ordering::SeqCst);
            let (_, lo, hi) = unpack(self.state.load(Ordering::SeqCst));
            if lo >= hi && !self.quit.load(Ordering::SeqCst) {
                std::thread::park();
            }
            self.parked_count.fetch_sub(1, Ordering::SeqCst);
            let mut parked = self.lock_parked();
            if let Some(i) = parked.iter().position(|t| t.id() == me.id()) {
                parked.swap_remove(i);
            }
            drop(parked);
            idle_since = None;
        }
    }
}

/// Run `f` on this thread (a rayon pool's) leading a team with `helpers`
/// jobs spawned into the pool; a helper whose thread `may_help` refuses
/// (one already running a forward) returns at once. The helpers are
/// released when `f` returns or unwinds, and this returns after them.
pub fn lead_with_helpers<R: Send>(
    helpers: usize,
    may_help: &(dyn Fn() -> bool + Sync),
    f: impl FnOnce() -> R + Send,
) -> R {
    struct Finish<'a>(&'a Team);
    impl Drop for Finish<'_> {
        fn drop(&mut self) {
            self.0.finish();
        }
    }
    let team = Team::new(helpers + 1);
    let mut out = None;
    rayon::scope(|s| {
        for _ in 0..helpers {
            s.spawn(|_| {
                if may_help() {
                    team.help();
                }
            });
        }
        let _finish = Finish(&team);
        out = Some(team.lead(f));
    });
    out.expect("the scope ran f")
}

/// The team this thread leads, if any.
fn leading<R>(f: impl FnOnce(Option<&Team>) -> R) -> R {
    let p = LEADING.with(|l| l.get());
    // SAFETY: `LEADING` holds a team only while `Team::lead` runs on this
    // thread with that team borrowed, and it is restored on the way out
    // (unwinding included), so a non-null pointer is a live team.
    f(unsafe { p.as_ref() })
}

/// Run `f` on every item, in parallel: through the team this thread leads,
/// else through rayon.
pub fn for_each<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    leading(|team| match team {
        Some(team) if items.len() > 1 && items.len() <= MAX_TASKS => {
            let slots: Vec<Mutex<Option<T>>> =
                items.into_iter().map(|t| Mutex::new(Some(t))).collect();
            team.run(slots.len(), false, &|i| {
                let item = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(item) = item {
                    f(item);
                }
            });
        }
        _ => items.into_par_iter().for_each(f),
    })
}

/// `f` of every item, in order, computed in parallel as `for_each` runs
/// but claimed one task at a time: its user, attention, has tasks of very
/// different costs (a prefill chunk's later tokens see more of the
/// context), which a claim of many could leave to one thread.
pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    leading(|team| match team {
        Some(team) if items.len() > 1 && items.len() <= MAX_TASKS => {
            let slots: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
            team.run(items.len(), true, &|i| {
                let r = f(&items[i]);
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
            slots
                .into_iter()
                .map(|s| {
                    s.into_inner()
                        .unwrap_or_else(|e| e.into_inner())
                        .expect("every task ran")
                })
                .collect()
        }
        _ => items.par_iter().map(f).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A team of the calling thread and `helpers` rayon threads running `f`.
    fn with_team<R: Send>(helpers: usize, f: impl FnOnce() -> R + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(helpers + 1)
            .build()
            .unwrap();
        pool.install(|| lead_with_helpers(helpers, &|| true, f))
    }

    #[test]
    fn sections_run_every_task_once_on_several_threads() {
        let (sums, threads) = with_team(2, || {
            let mut sums = Vec::new();
            let threads = Mutex::new(std::collections::HashSet::new());
            for round in 0..2000usize {
                let n = 1 + round % 37;
                let items: Vec<usize> = (0..n).collect();
                let out = map(&items, |&i| {
                    threads.lock().unwrap().insert(std::thread::current().id());
                    // Uneven work, so threads interleave.
                    std::hint::black_box((0..(i % 5) * 200).sum::<usize>());
                    i
                });
                assert_eq!(out, items, "round {round}");
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for_each(items.clone(), |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                sums.push(out.iter().sum::<usize>());
            }
            (sums, threads.into_inner().unwrap().len())
        });
        assert_eq!(sums.len(), 2000);
        assert!(threads > 1, "helpers took tasks");
    }

    #[test]
    fn a_task_panic_reaches_the_leader_after_the_section_ends() {
        let finished = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            with_team(1, || {
                for_each((0..64).collect::<Vec<usize>>(), |i| {
                    if i == 7 {
                        panic!("task 7");
                    }
                    std::thread::sleep(Duration::from_micros(50));
                    finished.fetch_add(1, Ordering::Relaxed);
                })
            })
        }));
        assert!(r.is_err(), "the panic was re-raised");
        assert_eq!(
            finished.load(Ordering::Relaxed),
            63,
            "every other task ran first"
        );
        // The team still works after a panic.
        let v = with_team(1, || map(&[1, 2, 3], |x| x * 2));
        assert_eq!(v, vec![2, 4, 6]);
    }

    #[test]
    fn helpers_park_through_a_long_pause_and_come_back() {
        let threads = with_team(1, || {
            let items: Vec<usize> = (0..64).collect();
            let _ = map(&items, |&i| i);
            std::thread::sleep(SPIN_IDLE * 4);
            let seen = Mutex::new(std::collections::HashSet::new());
            for _ in 0..50 {
                for_each(items.clone(), |_| {
                    seen.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(Duration::from_micros(20));
                });
            }
            seen.into_inner().unwrap().len()
        });
        assert_eq!(threads, 2, "the parked helper was woken for later sections");
    }

    #[test]
    fn a_section_inside_a_task_runs_apart_from_the_outer_one() {
        let sums = with_team(3, || {
            let outer: Vec<usize> = (0..40).collect();
            map(&outer, |&i| {
                let inner: Vec<usize> = (0..i % 9 + 1).collect();
                map(&inner, |&j| i * 100 + j).iter().sum::<usize>()
            })
        });
        for (i, s) in sums.iter().enumerate() {
            let n = i % 9 + 1;
            assert_eq!(*s, i * 100 * n + n * (n - 1) / 2, "outer task {i}");
        }
    }

    #[test]
    fn without_a_team_sections_run_through_rayon() {
        let items: Vec<u64> = (0..100).collect();
        assert_eq!(map(&items, |x| x * x)[99], 9801);
        let sum = AtomicU64::new(0);
        for_each(items, |x| {
            sum.fetch_add(x, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }
}

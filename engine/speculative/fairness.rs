//! Fair scheduling across requests: which waiting sequence is admitted
//! next, which running one gives up its slot to a starved request, and how
//! a step's prefill budget is shared. Pure functions over `Slot`s; the
//! scheduler applies their answers (and tests drive them directly).
//!
//! A *group* is one API request: its prompts and its `n` choices. A
//! *priority* is the request's (lower runs first, as vLLM's).
//!
//! Invariants:
//! - A better priority always comes first: admission, slots and prefill
//!   budget go to the best priority present before any worse one.
//! - Within a priority, admission picks the group holding the fewest
//!   running slots (ties: the oldest sequence), so a new request is
//!   admitted at the next free slot however many sequences an older
//!   request still has queued.
//! - A slot is taken back (preemption by recompute) only from a strictly
//!   worse priority, or for a group that has no slot at all from a group
//!   that holds two or more at the same priority: each arrival preempts at
//!   most once, and the victim's group never drops below the starved one,
//!   so slots cannot ping-pong between requests.
//! - Prefill budget, within a priority: groups whose whole remaining
//!   prefill fits go first, smallest first, within three quarters of the
//!   step's budget (all of it when the step before brought no first
//!   token; a chat's prompt is prefilled, and its first token
//!   drawn, in the step after it arrives); the rest is water-filled, each
//!   group an equal share capped at what it still needs, what one leaves
//!   going to the others (so a long prompt gets at least a quarter of the
//!   budget shared among the long ones every other step: it cannot
//!   starve). In a step where some group fits whole, the others share only
//!   that quarter, or nothing when the step before brought no first token
//!   (then the groups that fit may take the whole budget), so the step that
//!   brings a first token is short.
//!   Within a group, sequences are served in admission order (its first
//!   prompt finishes first).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::SeqId;

/// How the scheduler admits waiting sequences and shares prefill budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduling {
    /// Fair across requests, by priority (this module).
    #[default]
    Fair,
    /// First come, first served by sequence, priorities ignored (the
    /// baseline `specd bench-load` compares against).
    Fcfs,
}

/// What the policy knows of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub id: SeqId,
    /// The API request it belongs to.
    pub group: u64,
    pub priority: i32,
    /// Positions in its target cache: what a preemption throws away.
    pub cached: usize,
    /// May not be preempted now (admitted this step, or tied to a fork).
    pub pinned: bool,
}

/// Running slots per group.
pub fn group_counts(running: &[Slot]) -> HashMap<u64, usize> {
    let mut counts = HashMap::new();
    for s in running {
        *counts.entry(s.group).or_insert(0) += 1;
    }
    counts
}

/// Index in `waiting` of the sequence to admit next: best priority, then
/// the group with the fewest running slots, then the oldest (lowest id).
pub fn next_admission(waiting: &[Slot], counts: &HashMap<u64, usize>) -> Option<usize> {
    waiting
        .iter()
        .enumerate()
        .min_by_key(|(_, s)| (s.priority, counts.get(&s.group).copied().unwrap_or(0), s.id))
        .map(|(i, _)| i)
}

/// The running sequence that gives its slot to `cand` when every slot is
/// taken, if any should: one of strictly worse priority (the worst, then
/// the least cached work, then the newest), else, when `cand`'s group has
/// no slot, one of the same priority from the group holding the most
/// slots (two or more; the least cached work, then the newest).
pub fn victim(cand: &Slot, running: &[Slot], counts: &HashMap<u64, usize>) -> Option<SeqId> {
    let free = running.iter().filter(|s| !s.pinned);
    let worse = free
        .clone()
        .filter(|s| s.priority > cand.priority)
        .max_by_key(|s| (s.priority, std::cmp::Reverse(s.cached), s.id));
    if let Some(v) = worse {
        return Some(v.id);
    }
    if counts.get(&cand.group).copied().unwrap_or(0) > 0 {
        return None;
    }
    free.filter(|s| s.priority == cand.priority && s.group != cand.group)
        .filter(|s| counts.get(&s.group).copied().unwrap_or(0) >= 2)
        .max_by_key(|s| {
            (
                counts.get(&s.group).copied().unwrap_or(0),
                std::cmp::Reverse(s.cached),
                s.id,
            )
        })
        .map(|s| s.id)
}

/// Share `budget` prefill tokens among `needs` (`(slot, tokens it still
/// needs)`, in admission order): tokens granted to each, in the same
/// order, and whether some group's whole prefill was granted (the step
/// brings a first token). Better priorities are served first; within one,
/// groups that fit whole go first, then the others are water-filled (see
/// the module's invariants). `light`: the previous step did not bring a
/// first token, so this one may give groups that fit whole the entire
/// budget and the others nothing (the step that brings a first token is
/// as short as it can be); otherwise groups that fit whole get three
/// quarters and the others share the quarter, so a stream of short
/// prompts leaves a long one a share at least every other step.
pub fn prefill_shares(budget: usize, needs: &[(Slot, usize)], light: bool) -> (Vec<usize>, bool) {
    let mut out = vec![0; needs.len()];
    let mut left = budget;
    let mut first = false;
    let mut prios: Vec<i32> = needs.iter().map(|(s, _)| s.priority).collect();
    prios.sort_unstable();
    prios.dedup();
    for p in prios {
        if left == 0 {
            break;
        }
        // Groups at this priority in order of first appearance, with
        // what each needs in all.
        let mut groups: Vec<(u64, usize)> = Vec::new();
        for (s, n) in needs.iter().filter(|(s, _)| s.priority == p) {
            match groups.iter_mut().find(|(g, _)| *g == s.group) {
                Some((_, total)) => *total += n,
                None => groups.push((s.group, *n)),
            }
        }
        let mut given = vec![0usize; groups.len()];
        // Groups that finish this step, smallest first, within three
        // quarters of what is left.
        let mut order: Vec<usize> = (0..groups.len()).collect();
        order.sort_by_key(|&i| groups[i].1);
        let quarter = if light { 0 } else { left / 4 };
        let mut pool = left - quarter;
        let mut whole = false;
        for i in order {
            if groups[i].1 <= pool {
                given[i] = groups[i].1;
                pool -= groups[i].1;
                left -= groups[i].1;
                whole = true;
            }
        }
        // A step that brings a group's first token stays light: the
        // groups that do not fit share only their guaranteed quarter, or
        // nothing when the step before brought none (the step in flight
        // plus this one is that group's wait).
        if whole {
            left = left.min(quarter);
            first = true;
        }
        loop {
            let open: Vec<usize> = (0..groups.len())
                .filter(|&i| given[i] < groups[i].1)
                .collect();
            if open.is_empty() || left == 0 {
                break;
            }
            let share = left / open.len();
            if share == 0 {
                // Fewer tokens than groups: one each, oldest groups first.
                for &i in open.iter().take(left) {
                    given[i] += 1;
                }
                left = 0;
                break;
            }
            for &i in &open {
                let g = share.min(groups[i].1 - given[i]);
                given[i] += g;
                left -= g;
            }
        }
        // Within a group, its sequences in admission order.
        for (gi, (g, _)) in groups.iter().enumerate() {
            let mut pool = given[gi];
            for (k, (s, n)) in needs.iter().enumerate() {
                if s.priority == p && s.group == *g && pool > 0 {
                    out[k] = (*n).min(pool);
                    pool -= out[k];
                }
            }
        }
    }
    (out, first)
}

/// The prefill cap of the next step under fair scheduling: `cap`
/// (`max_prefill_tokens`) while some request waits on the engine's
/// latency, else doubling with each `quiet` step before it, up to `ceiling`
/// (`max_batch_tokens`). A step is quiet when every decoding sequence
/// belongs to a request that still has prompt tokens to prefill (a batch
/// request's own finished prompts): no other request's time per output
/// token rides on the step's length, so long prompts may take bigger,
/// cheaper chunks. A request that arrives then waits for at most the step
/// in flight (as under FCFS with chunked prefill); once it decodes, the
/// next step is back at `cap`.
pub fn prefill_cap(cap: usize, ceiling: usize, quiet: u32) -> usize {
    let cap = cap.max(1);
    cap.checked_shl(quiet.min(16))
        .unwrap_or(usize::MAX)
        .min(ceiling.max(cap))
}

/// Whether a step with these sequences is quiet (see `prefill_cap`):
/// `(group, decoding)` for every running and waiting sequence.
pub fn quiet(seqs: &[(u64, bool)]) -> bool {
    let prefilling: std::collections::HashSet<u64> = seqs
        .iter()
        .filter(|(_, decoding)| !decoding)
        .map(|(g, _)| *g)
        .collect();
    !prefilling.is_empty()
        && seqs
            .iter()
            .all(|(g, decoding)| !decoding || prefilling.contains(g))
}

/// Label value for a priority in metrics: the number from -10 to 10,
/// else `below_-10` / `above_10` (clients choose priorities; the label set
/// stays bounded).
pub fn priority_label(p: i32) -> String {
    match p {
        p if p < -10 => "below_-10".into(),
        p if p > 10 => "above_10".into(),
        p => p.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: SeqId, group: u64, priority: i32, cached: usize) -> Slot {
        Slot {
            id,
            group,
            priority,
            cached,
            pinned: false,
        }
    }

    #[test]
    fn admission_prefers_priority_then_the_group_with_fewest_slots_then_age() {
        let running = [slot(1, 1, 0, 10), slot(2, 1, 0, 10), slot(3, 2, 0, 10)];
        let counts = group_counts(&running);
        // Group 1's next prompt is older, but group 2 holds fewer slots and
        // group 3 none.
        let waiting = [slot(4, 1, 0, 0), slot(7, 2, 0, 0), slot(9, 3, 0, 0)];
        assert_eq!(next_admission(&waiting, &counts), Some(2));
        assert_eq!(next_admission(&waiting[..2], &counts), Some(1));
        // A better priority beats every fairness key.
        let waiting = [slot(9, 3, 0, 0), slot(11, 1, -1, 0)];
        assert_eq!(next_admission(&waiting, &counts), Some(1));
        // Same group and priority: the oldest.
        let waiting = [slot(12, 5, 0, 0), slot(10, 5, 0, 0)];
        assert_eq!(next_admission(&waiting, &counts), Some(1));
        assert_eq!(next_admission(&[], &counts), None);
    }

    #[test]
    fn a_starved_request_takes_one_slot_from_the_largest_group_only() {
        let running = [
            slot(1, 1, 0, 500),
            slot(2, 1, 0, 64),
            slot(3, 1, 0, 900),
            slot(4, 2, 0, 5),
        ];
        let counts = group_counts(&running);
        // The least cached work of the group with the most slots (not
        // group 2's, which has a single slot).
        assert_eq!(victim(&slot(9, 3, 0, 0), &running, &counts), Some(2));
        // A group that already runs waits for a free slot.
        assert_eq!(victim(&slot(9, 2, 0, 0), &running, &counts), None);
        // Nobody holds two slots: nothing to take.
        let spread = [slot(1, 1, 0, 1), slot(2, 2, 0, 1)];
        assert_eq!(
            victim(&slot(9, 3, 0, 0), &spread, &group_counts(&spread)),
            None
        );
        // A worse priority is never a victim's equal: a better-priority
        // request does not preempt for fairness.
        let low = [slot(1, 1, 0, 1), slot(2, 1, 0, 1)];
        assert_eq!(victim(&slot(9, 3, 1, 0), &low, &group_counts(&low)), None);
        // Pinned sequences are never chosen.
        let pinned = [
            Slot {
                pinned: true,
                ..slot(1, 1, 0, 1)
            },
            slot(2, 1, 0, 50),
        ];
        assert_eq!(
            victim(&slot(9, 3, 0, 0), &pinned, &group_counts(&pinned)),
            Some(2)
        );
    }

    #[test]
    fn a_better_priority_preempts_the_worst_running_one() {
        let running = [slot(1, 1, 0, 10), slot(2, 2, 5, 300), slot(3, 3, 5, 20)];
        let counts = group_counts(&running);
        assert_eq!(victim(&slot(9, 1, -1, 0), &running, &counts), Some(3));
        // Even a group that already runs, and from a group of one slot.
        assert_eq!(victim(&slot(9, 2, 2, 0), &running, &counts), Some(3));
        // Nothing worse than 5.
        assert_eq!(victim(&slot(9, 4, 5, 0), &running, &counts), None);
    }

    #[test]
    fn prefill_budget_is_water_filled_across_groups_by_priority() {
        // One big request with three prompts, a small one, a medium one.
        let needs = [
            (slot(1, 1, 0, 0), 2000),
            (slot(2, 1, 0, 0), 2000),
            (slot(3, 1, 0, 0), 2000),
            (slot(4, 2, 0, 0), 30),
            (slot(5, 3, 0, 0), 400),
        ];
        // Group 2 fits whole; the other two share the quarter (128).
        assert_eq!(prefill_shares(512, &needs, false).0, vec![64, 0, 0, 30, 64]);
        // Without a group that fits whole, everything is water-filled.
        assert_eq!(prefill_shares(512, &needs[..3], false).0, vec![512, 0, 0]);
        let no_chat = [needs[0], needs[4]];
        assert_eq!(prefill_shares(512, &no_chat, false).0, vec![256, 256]);
        // Marked as a step that brings a first token; with the step before
        // bringing none, the chat takes what it needs and the long ones
        // get nothing (the step is as short as it can be).
        assert!(prefill_shares(512, &needs, false).1);
        assert_eq!(
            prefill_shares(512, &needs, true),
            (vec![0, 0, 0, 30, 400], true)
        );
        // A chat arriving at every step cannot starve a long prompt: the
        // step after one that brought a first token gives it its quarter.
        let mut light = true;
        let mut long = 0;
        for step in 0..10 {
            let needs = [
                (slot(1, 1, 0, 0), 900),
                (slot(2 + step, 2 + step, 0, 0), 30),
            ];
            let (got, first) = prefill_shares(64, &needs, light);
            assert!(first);
            if !light {
                assert!(got[0] >= 16, "step {step}: {got:?}");
            }
            long += got[0];
            light = !first;
        }
        assert!(long >= 5 * 16, "{long}");
        assert_eq!(
            prefill_shares(512, &needs[..3], true),
            (vec![512, 0, 0], false)
        );
        // A 40-token chat beside two long requests in a 64-token step: it
        // fits whole (within 48) and goes first; the long ones share the
        // quarter, 16.
        let needs = [
            (slot(1, 1, 0, 0), 900),
            (slot(2, 2, 0, 0), 900),
            (slot(3, 3, 0, 0), 40),
        ];
        assert_eq!(prefill_shares(64, &needs, false).0, vec![8, 8, 40]);
        // Never more than three quarters to groups that fit whole: the
        // second chat does not fit in what is left of the 48 and shares
        // the quarter with the long one.
        let needs = [
            (slot(1, 1, 0, 0), 900),
            (slot(2, 2, 0, 0), 30),
            (slot(3, 3, 0, 0), 30),
        ];
        assert_eq!(prefill_shares(64, &needs, false).0, vec![8, 30, 8]);
        // A better priority takes what it needs first; its first token's
        // step stays light for the worse one too (the quarter).
        let needs = [(slot(1, 1, 0, 0), 2000), (slot(2, 2, -1, 0), 100)];
        assert_eq!(prefill_shares(512, &needs, false).0, vec![128, 100]);
        let needs = [(slot(1, 1, 0, 0), 2000), (slot(2, 2, -1, 0), 1000)];
        assert_eq!(prefill_shares(512, &needs, false).0, vec![0, 512]);
        // Enough for everyone: everyone's need.
        let needs = [(slot(1, 1, 0, 0), 10), (slot(2, 1, 0, 0), 20)];
        assert_eq!(prefill_shares(512, &needs, false).0, vec![10, 20]);
        // Fewer tokens than groups: one each, oldest groups first.
        let needs = [
            (slot(1, 1, 0, 0), 10),
            (slot(2, 2, 0, 0), 10),
            (slot(3, 3, 0, 0), 10),
        ];
        assert_eq!(prefill_shares(2, &needs, false).0, vec![1, 1, 0]);
        assert_eq!(prefill_shares(0, &needs, false).0, vec![0, 0, 0]);
        // Never more than the budget, never more than a need.
        let needs: Vec<_> = (0..7)
            .map(|i| (slot(i, i % 3, (i % 2) as i32, 0), 37 * i as usize + 1))
            .collect();
        for budget in [0, 1, 5, 64, 100, 512, 4096] {
            let got = prefill_shares(budget, &needs, false).0;
            let want: usize = needs.iter().map(|(_, n)| n).sum();
            assert!(got.iter().sum::<usize>() <= budget.min(want), "{budget}");
            assert!(got.iter().zip(&needs).all(|(g, (_, n))| g <= n));
        }
        // Within one priority, every group that does not fit whole gets
        // something while tokens last (its share of at least the quarter:
        // none starves).
        let needs: Vec<_> = (0..7)
            .map(|i| (slot(i, i, 0, 0), 37 * i as usize + 1))
            .collect();
        for budget in [28, 64, 100, 512] {
            let got = prefill_shares(budget, &needs, false).0;
            assert!(got.iter().all(|&g| g > 0), "{budget}: {got:?}");
        }
    }

    #[test]
    fn the_prefill_cap_opens_only_while_no_other_request_decodes() {
        // A batch request (group 1) prefilling while its finished prompts
        // decode: quiet. A chat (group 2) decoding: not. Nothing to
        // prefill: not (the cap does not matter then).
        assert!(quiet(&[(1, false), (1, true), (1, false)]));
        assert!(!quiet(&[(1, false), (1, true), (2, true)]));
        assert!(quiet(&[(1, false), (2, false)]));
        assert!(!quiet(&[(1, true)]));
        assert!(!quiet(&[]));
        // The cap doubles per quiet step up to the ceiling.
        assert_eq!(prefill_cap(64, 512, 0), 64);
        assert_eq!(prefill_cap(64, 512, 1), 128);
        assert_eq!(prefill_cap(64, 512, 3), 512);
        assert_eq!(prefill_cap(64, 512, 40), 512);
        // A ceiling below the cap never lowers it.
        assert_eq!(prefill_cap(64, 32, 2), 64);
        assert_eq!(prefill_cap(0, 512, 0), 1);
    }

    #[test]
    fn priority_labels_stay_bounded() {
        assert_eq!(priority_label(0), "0");
        assert_eq!(priority_label(-10), "-10");
        assert_eq!(priority_label(11), "above_10");
        assert_eq!(priority_label(i32::MIN), "below_-10");
    }
}

//! Admission: which waiting sequences start, in which running slot, and
//! which running sequence a better claim preempts (first come, first
//! served, or fair by priority and request through `fairness`); forked
//! choices that start from their parent's prompt KV.
//!
//! Invariants: with `Scheduling::Fair`, `running` stays ordered by
//! priority (then admission); a preempted sequence goes back to the front
//! of the queue with its cache released and is recomputed from its
//! committed tokens; a fork and its parent are never preempted while the
//! copy is pending.

use super::fairness::{self, Scheduling, Slot};
use super::proposer::Capabilities;
use super::scheduler::{Scheduler, SeqStatus};
use super::SeqId;

/// Whether a waiting forked choice can start from its parent's KV.
pub(super) enum Fork {
    /// The parent is still prefilling: wait for it.
    Wait,
    /// Copy the parent's cache; this many positions are then cached.
    From(SeqId, usize),
    /// Prefill as any request does.
    No,
}

impl Scheduler {
    /// Admission first come, first served by sequence.
    pub(super) fn admit_fcfs<'c>(&mut self, caps: &impl Fn(&str) -> Option<&'c Capabilities>) {
        let mut deferred = Vec::new();
        while self.running.len() < self.config.max_running {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            match self.fork_source(id, caps) {
                Fork::Wait => deferred.push(id),
                fork => self.start(id, fork, caps),
            }
        }
        for id in deferred.into_iter().rev() {
            self.waiting.push_front(id);
        }
    }

    /// Fair admission (see `fairness`): the best waiting sequence takes a
    /// free slot, or one a worse priority or a request holding several
    /// gives up (preempted by recompute).
    pub(super) fn admit_fair<'c>(&mut self, caps: &impl Fn(&str) -> Option<&'c Capabilities>) {
        let mut deferred: Vec<SeqId> = Vec::new();
        let mut admitted: Vec<SeqId> = Vec::new();
        loop {
            let cands: Vec<Slot> = self
                .waiting
                .iter()
                .filter(|id| !deferred.contains(id))
                .filter_map(|&id| self.slot(id, false))
                .collect();
            // Forks tie a parent to its choices: neither is preempted
            // while a copy is pending.
            let parents: Vec<SeqId> = self
                .running
                .iter()
                .filter_map(|id| self.seqs.get(id)?.fork_from)
                .collect();
            let running: Vec<Slot> = self
                .running
                .iter()
                .filter_map(|&id| {
                    let pinned = admitted.contains(&id) || parents.contains(&id);
                    self.slot(id, pinned)
                })
                .collect();
            let counts = fairness::group_counts(&running);
            let Some(i) = fairness::next_admission(&cands, &counts) else {
                break;
            };
            let cand = cands[i];
            let fork = self.fork_source(cand.id, caps);
            if matches!(fork, Fork::Wait) {
                deferred.push(cand.id);
                continue;
            }
            if self.running.len() >= self.config.max_running {
                let Some(v) = fairness::victim(&cand, &running, &counts) else {
                    break;
                };
                let worse = self
                    .seqs
                    .get(&v)
                    .is_some_and(|s| s.req.priority > cand.priority);
                self.requeue(v, if worse { "priority" } else { "fairness" });
            }
            self.waiting.retain(|&w| w != cand.id);
            self.start(cand.id, fork, caps);
            admitted.push(cand.id);
        }
    }

    /// What the fairness policy sees of sequence `id`.
    pub(super) fn slot(&self, id: SeqId, pinned: bool) -> Option<Slot> {
        let s = self.seqs.get(&id)?;
        Some(Slot {
            id,
            group: s.group,
            priority: s.req.priority,
            cached: s.cached,
            pinned: pinned || s.fork_from.is_some(),
        })
    }

    /// Move waiting sequence `id` (already out of `waiting`) into a
    /// running slot: fair scheduling keeps `running` ordered by priority.
    pub(super) fn start<'c>(
        &mut self,
        id: SeqId,
        fork: Fork,
        caps: &impl Fn(&str) -> Option<&'c Capabilities>,
    ) {
        let fork = match fork {
            Fork::From(p, cached) => Some((p, cached)),
            _ => None,
        };
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.drop_cache(SeqStatus::Prefill);
        s.prompt_logprobs.clear();
        if let Some((p, cached)) = fork {
            s.cached = cached;
            s.fork_from = Some(p);
            s.status = SeqStatus::Decoding;
        }
        if !s.admitted_once {
            s.admitted_once = true;
            metrics::histogram!("specd_queue_wait_seconds", "priority" => fairness::priority_label(s.req.priority))
                .record(s.arrived.elapsed().as_secs_f64());
        }
        // Every sequence starts in the drafter (plain ones too: shadow
        // proposers score all traffic), with the proposer it asked for
        // (not a retired instance it drafted with before a preemption).
        if s.proposer.is_some() {
            s.proposer = Some(s.stats.proposer.clone());
        }
        let name = s.proposer.clone().unwrap_or_else(|| "none".into());
        s.policy.tree = caps(&name)
            .filter(|c| c.tree)
            .map(|c| super::policy::TreePolicy::new(c.max_draft));
        self.lifecycle.starts.push((id, name, s.tokens.clone()));
        let at = match self.config.scheduling {
            Scheduling::Fcfs => self.running.len(),
            Scheduling::Fair => {
                let p = s.req.priority;
                let seqs = &self.seqs;
                self.running
                    .iter()
                    .position(|r| seqs.get(r).is_some_and(|o| o.req.priority > p))
                    .unwrap_or(self.running.len())
            }
        };
        self.running.insert(at, id);
    }

    /// Preempt running sequence `id`: its cache and proposer state are
    /// released, and it waits at the front of the queue to be recomputed
    /// from its committed tokens (its sampler state stays).
    pub(super) fn requeue(&mut self, id: SeqId, reason: &'static str) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.drop_cache(SeqStatus::Waiting);
        s.preemptions += 1;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.lifecycle.released.push(id);
        metrics::counter!("specd_preemptions_total", "reason" => reason).increment(1);
    }

    /// Whether waiting sequence `id` may start from its parent's prompt KV.
    pub(super) fn fork_source<'c>(
        &self,
        id: SeqId,
        caps: &impl Fn(&str) -> Option<&'c Capabilities>,
    ) -> Fork {
        let Some(s) = self.seqs.get(&id) else {
            return Fork::No;
        };
        let Some(p) = s.req.fork_of else {
            return Fork::No;
        };
        // Recomputed after a preemption, or a proposer that must see the
        // prompt's hidden states: a prefill of its own.
        let name = s.proposer.as_deref().unwrap_or("none");
        if s.preemptions > 0
            || s.req.prompt_logprobs.is_some()
            || caps(name).is_some_and(|c| !c.hidden_layers.is_empty())
        {
            return Fork::No;
        }
        let Some(parent) = self.seqs.get(&p) else {
            return Fork::No;
        };
        // Its window past the prompt may be gone: a prefill of its own.
        if parent.window_past_prompt {
            return Fork::No;
        }
        if parent.prompt_len != s.prompt_len
            || parent.tokens[..parent.prompt_len] != s.tokens[..s.prompt_len]
        {
            return Fork::No;
        }
        match parent.status {
            SeqStatus::Waiting | SeqStatus::Prefill => Fork::Wait,
            SeqStatus::Decoding
                if parent.cached >= parent.prefill_target() && parent.fork_from.is_none() =>
            {
                Fork::From(p, s.prefill_target())
            }
            SeqStatus::Decoding => Fork::Wait,
            _ => Fork::No,
        }
    }
}

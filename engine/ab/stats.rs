//! Summaries of an A/B run: throughput speedup against plain decoding with
//! a paired bootstrap interval, acceptance (from `SpecStats`), latency
//! percentiles, and the greedy token-for-token comparison.

use std::collections::BTreeMap;

use super::{ArmSummary, Mismatch, Record};
use crate::sampler::Rng;
use crate::speculative::SpecStats;

use crate::bench_load::percentile;

/// Summaries of `records` per arm, speedup against `plain`.
pub fn summarize(
    records: &[&Record],
    arms: &[String],
    plain: &str,
    bootstrap: usize,
    seed: u64,
) -> Vec<ArmSummary> {
    let by_arm =
        |a: &str| -> Vec<&Record> { records.iter().copied().filter(|r| r.arm == a).collect() };
    let base = by_arm(plain);
    // The unit of cost: the plain arm's mean one-token decode step on the
    // same prompt (and repeat), else over all prompts. Per prompt, because
    // a step's cost grows with its context and arms draft more on some
    // prompts (long, repetitive ones) than others: against one global unit
    // a drafting arm's steps would look dearer than they are.
    let one_token = |rs: &mut dyn Iterator<Item = &Record>| {
        let (n, v) = rs
            .flat_map(|r| r.steps_by_tokens.iter())
            .filter(|e| e.0 == 1)
            .fold((0u64, 0f64), |a, e| (a.0 + e.1, a.1 + e.2));
        (n > 0).then(|| v / n as f64)
    };
    let global_unit = one_token(&mut base.iter().copied()).unwrap_or(0.0);
    let key = |r: &Record| (r.prompt_id.clone(), r.repeat);
    let base_map: BTreeMap<_, &Record> = base.iter().map(|r| (key(r), *r)).collect();
    let unit_of = |r: &Record| -> f64 {
        base_map
            .get(&key(r))
            .and_then(|b| one_token(&mut std::iter::once(*b)))
            .unwrap_or(global_unit)
    };
    arms.iter()
        .map(|arm| {
            let rs = by_arm(arm);
            let tokens: usize = rs.iter().map(|r| r.tokens).sum();
            let time: f64 = rs.iter().map(|r| r.wall_s).sum();
            // Paired (arm, plain) per prompt and repeat.
            let pairs: Vec<(&Record, &Record)> = rs
                .iter()
                .filter_map(|r| base_map.get(&key(r)).map(|b| (*r, *b)))
                .collect();
            let ratio = |ps: &[(&Record, &Record)]| -> f64 {
                let (at, aw, bt, bw) = ps.iter().fold((0.0, 0.0, 0.0, 0.0), |acc, (a, b)| {
                    (
                        acc.0 + a.tokens as f64,
                        acc.1 + a.wall_s,
                        acc.2 + b.tokens as f64,
                        acc.3 + b.wall_s,
                    )
                });
                if aw > 0.0 && bt > 0.0 {
                    (at / aw) / (bt / bw)
                } else {
                    0.0
                }
            };
            let speedup = ratio(&pairs);
            // Repeats of a prompt are nearly the same run (greedy: the same
            // tokens): the bootstrap resamples prompts, each with all its
            // repeats, so the interval reflects the number of prompts, not
            // prompts x repeats.
            let mut by_prompt: BTreeMap<&str, Vec<(&Record, &Record)>> = BTreeMap::new();
            for &(a, b) in &pairs {
                by_prompt
                    .entry(a.prompt_id.as_str())
                    .or_default()
                    .push((a, b));
            }
            let clusters: Vec<Vec<(&Record, &Record)>> = by_prompt.into_values().collect();
            let mut rng = Rng::new(seed);
            let mut boots: Vec<f64> = (0..if clusters.is_empty() { 0 } else { bootstrap })
                .map(|_| {
                    let sample: Vec<(&Record, &Record)> = (0..clusters.len())
                        .flat_map(|_| {
                            clusters[(rng.next_u64() % clusters.len() as u64) as usize]
                                .iter()
                                .copied()
                        })
                        .collect();
                    ratio(&sample)
                })
                .collect();
            boots.sort_by(f64::total_cmp);
            let ci = (percentile(&boots, 0.025), percentile(&boots, 0.975));
            let mut spec = SpecStats::default();
            for r in &rs {
                spec.add(&r.spec());
            }
            let ttft: Vec<f64> = rs.iter().map(|r| r.ttft_s * 1e3).collect();
            let tpot: Vec<f64> = rs
                .iter()
                .filter(|r| r.tokens > 1)
                .map(|r| r.tpot_s * 1e3)
                .collect();
            let fwd: u64 = rs.iter().map(|r| r.target_forwards).sum();
            // Steps, verify and draft time by tokens fed, the times in units
            // of each prompt's plain step.
            let mut by_tokens: BTreeMap<usize, (u64, f64, f64)> = BTreeMap::new();
            for r in &rs {
                let unit = unit_of(r);
                let per_unit = |x: f64| if unit > 0.0 { x / unit } else { 0.0 };
                for &(k, n, v, d) in &r.steps_by_tokens {
                    let e = by_tokens.entry(k).or_default();
                    e.0 += n;
                    e.1 += per_unit(v);
                    e.2 += per_unit(d);
                }
            }
            let (steps, draft): (u64, f64) = by_tokens
                .values()
                .fold((0, 0.0), |a, e| (a.0 + e.0, a.1 + e.2));
            let mut members: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
            for r in &rs {
                for (m, a, b, c) in &r.members {
                    let e = members.entry(m.clone()).or_default();
                    e.0 += a;
                    e.1 += b;
                    e.2 += c;
                }
            }
            ArmSummary {
                draft_cost_per_step: if steps > 0 { draft / steps as f64 } else { 0.0 },
                verify_cost_by_tokens: by_tokens
                    .iter()
                    .map(|(&k, e)| (k, e.0, e.1 / e.0.max(1) as f64))
                    .collect(),
                members: members
                    .into_iter()
                    .map(|(m, (a, b, c))| (m, a, b, c))
                    .collect(),
                arm: arm.clone(),
                requests: rs.len(),
                tokens,
                tok_per_s: if time > 0.0 {
                    tokens as f64 / time
                } else {
                    0.0
                },
                speedup,
                speedup_ci95: ci,
                mean_accepted_length: spec.mean_accepted_len(),
                acceptance_rate: spec.acceptance_rate(),
                acceptance_by_position: spec.acceptance_by_position(),
                ttft_p50_ms: percentile(&ttft, 0.5),
                ttft_p95_ms: percentile(&ttft, 0.95),
                tpot_p50_ms: percentile(&tpot, 0.5),
                tpot_p95_ms: percentile(&tpot, 0.95),
                forwards_per_token: if tokens > 0 {
                    fwd as f64 / tokens as f64
                } else {
                    0.0
                },
            }
        })
        .collect()
}

/// Token-for-token comparison of every arm in `records` with `plain`.
pub fn token_mismatches(records: &[&Record], plain: &str) -> Vec<Mismatch> {
    let base: BTreeMap<(String, usize), &Record> = records
        .iter()
        .filter(|r| r.arm == plain)
        .map(|&r| ((r.prompt_id.clone(), r.repeat), r))
        .collect();
    let mut out = Vec::new();
    for r in records.iter().filter(|r| r.arm != plain) {
        if let Some(b) = base.get(&(r.prompt_id.clone(), r.repeat)) {
            if r.token_ids != b.token_ids {
                let position = r
                    .token_ids
                    .iter()
                    .zip(&b.token_ids)
                    .position(|(x, y)| x != y)
                    .unwrap_or(r.token_ids.len().min(b.token_ids.len()));
                out.push(Mismatch {
                    prompt_id: r.prompt_id.clone(),
                    arm: r.arm.clone(),
                    repeat: r.repeat,
                    position,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, arm: &str, tokens: Vec<u32>, wall: f64) -> Record {
        Record {
            prompt_id: id.into(),
            category: "c".into(),
            arm: arm.into(),
            repeat: 0,
            prompt_tokens: 5,
            tokens: tokens.len(),
            token_ids: tokens,
            wall_s: wall,
            ttft_s: 0.1,
            tpot_s: 0.01,
            verify_steps: 4,
            target_forwards: 5,
            drafted: 8,
            accepted: 4,
            drafted_by_pos: vec![4, 4],
            accepted_by_pos: vec![3, 1],
            draft_s: 0.0,
            verify_s: 0.0,
            steps_by_tokens: Vec::new(),
            members: Vec::new(),
            finish_stop: true,
            complete: None,
        }
    }

    #[test]
    fn repeats_of_a_prompt_do_not_narrow_the_interval() {
        // 8 prompts whose speedups spread from 0.8x to 1.5x. Five repeats
        // of each (the same run again, as greedy repeats nearly are) add
        // no information: the interval must stay as wide, not shrink by
        // about the square root of 5.
        let speed = |i: usize| 0.8 + 0.1 * i as f64;
        let records = |repeats: usize| -> Vec<Record> {
            let mut v = Vec::new();
            for i in 0..8 {
                for rep in 0..repeats {
                    let id = format!("p{i}");
                    let mut p = rec(&id, "plain", vec![1; 10], 1.0);
                    let mut a = rec(&id, "spec", vec![1; 10], 1.0 / speed(i));
                    p.repeat = rep;
                    a.repeat = rep;
                    v.extend([p, a]);
                }
            }
            v
        };
        let width = |repeats: usize| {
            let rs = records(repeats);
            let refs: Vec<&Record> = rs.iter().collect();
            let s = summarize(&refs, &["plain".into(), "spec".into()], "plain", 2000, 3);
            s[1].speedup_ci95.1 - s[1].speedup_ci95.0
        };
        let (one, five) = (width(1), width(5));
        assert!(one > 0.1, "{one}");
        assert!(
            five > 0.8 * one,
            "five repeats narrowed the CI: {five} vs {one}"
        );
    }

    #[test]
    fn costs_are_in_units_of_the_plain_decode_step() {
        let mut plain = rec("a", "plain", vec![1, 2], 1.0);
        // 10 one-token steps of 20 ms each.
        plain.steps_by_tokens = vec![(1, 10, 0.2, 0.0)];
        let mut spec = rec("a", "spec", vec![1, 2], 0.5);
        // 4 steps verifying 5 tokens at 30 ms, drafting 2 ms each.
        spec.steps_by_tokens = vec![(5, 4, 0.12, 0.008)];
        spec.members = vec![("m".into(), 4, 16, 9)];
        let s = summarize(
            &[&plain, &spec],
            &["plain".into(), "spec".into()],
            "plain",
            10,
            1,
        );
        assert!(
            (s[1].draft_cost_per_step - 0.1).abs() < 1e-9,
            "{}",
            s[1].draft_cost_per_step
        );
        assert_eq!(s[1].verify_cost_by_tokens.len(), 1);
        let (k, n, c) = s[1].verify_cost_by_tokens[0];
        assert_eq!((k, n), (5, 4));
        assert!((c - 1.5).abs() < 1e-9, "{c}");
        assert_eq!(s[1].members, vec![("m".to_string(), 4, 16, 9)]);
    }

    #[test]
    fn costs_are_per_prompt_so_where_an_arm_drafts_does_not_bias_them() {
        // Prompt a (short context): plain steps of 10 ms. Prompt b (long
        // context): 30 ms. The arm drafts only on b, where a 2-token step
        // takes 33 ms: 1.1 of b's plain step (against the global mean of
        // 20 ms it would look like 1.65). Its one-token steps on a cost
        // exactly a's plain step.
        let mut pa = rec("a", "plain", vec![1], 1.0);
        pa.steps_by_tokens = vec![(1, 10, 0.1, 0.0)];
        let mut pb = rec("b", "plain", vec![1], 1.0);
        pb.steps_by_tokens = vec![(1, 10, 0.3, 0.0)];
        let mut sa = rec("a", "spec", vec![1], 1.0);
        sa.steps_by_tokens = vec![(1, 10, 0.1, 0.001)];
        let mut sb = rec("b", "spec", vec![1], 1.0);
        sb.steps_by_tokens = vec![(2, 10, 0.33, 0.003)];
        let s = summarize(
            &[&pa, &pb, &sa, &sb],
            &["plain".into(), "spec".into()],
            "plain",
            10,
            1,
        );
        let c = &s[1].verify_cost_by_tokens;
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].0, c[0].1), (1, 10));
        assert!((c[0].2 - 1.0).abs() < 1e-9, "{c:?}");
        assert_eq!((c[1].0, c[1].1), (2, 10));
        assert!((c[1].2 - 1.1).abs() < 1e-9, "{c:?}");
        // Draft: 0.1 ms / 10 ms on a, 0.3 ms / 30 ms on b: 0.01 per step.
        assert!((s[1].draft_cost_per_step - 0.01).abs() < 1e-9);
    }

    #[test]
    fn mismatches_name_prompt_arm_and_position() {
        let rs = [
            rec("p1", "plain", vec![1, 2, 3], 1.0),
            rec("p1", "ngram", vec![1, 2, 3], 0.5),
            rec("p2", "plain", vec![4, 5, 6], 1.0),
            rec("p2", "ngram", vec![4, 9, 6], 0.5),
        ];
        let m = token_mismatches(&rs.iter().collect::<Vec<_>>(), "plain");
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].prompt_id.as_str(), m[0].arm.as_str(), m[0].position),
            ("p2", "ngram", 1)
        );
    }

    #[test]
    fn speedup_is_a_throughput_ratio_with_a_bootstrap_interval() {
        let mut rs = Vec::new();
        for i in 0..20 {
            let id = format!("p{i}");
            rs.push(rec(&id, "plain", vec![1; 10], 1.0));
            rs.push(rec(
                &id,
                "fast",
                vec![1; 10],
                if i % 2 == 0 { 0.4 } else { 0.6 },
            ));
        }
        let refs: Vec<&Record> = rs.iter().collect();
        let s = summarize(&refs, &["plain".into(), "fast".into()], "plain", 500, 1);
        assert!((s[0].speedup - 1.0).abs() < 1e-9);
        assert!((s[1].speedup - 2.0).abs() < 1e-9, "{}", s[1].speedup);
        assert!(
            s[1].speedup_ci95.0 <= 2.0 && s[1].speedup_ci95.1 >= 2.0 && s[1].speedup_ci95.0 > 1.6
        );
        assert!((s[1].mean_accepted_length - 2.0).abs() < 1e-9);
        assert_eq!(s[1].acceptance_by_position, vec![0.75, 0.25]);
    }
}

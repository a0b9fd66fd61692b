//! `specd distill corpus`: a training corpus for a target, generated
//! through the engine in resumable shards and kept as compressed token ids
//! with each sample's provenance, so it can be committed, checked and
//! extended over several sessions, and every trainer can read it
//! (`--corpus DIR`) instead of generating its own text.
//!
//! Shards alternate two kinds:
//! - `instructions` (even shards): the `varied` mix's first-stage prompts
//!   (instructions, code stubs, role-play, arithmetic, reasoning) as one
//!   endless stream, each shard taking up where the previous instruction
//!   shard stopped. The first pass over the list answers every second
//!   prompt greedily and the others sampled; later passes sample every
//!   prompt with new seeds, so responses do not repeat.
//! - `conversations` (odd shards): tasks over passages the target wrote in
//!   the instruction shards before it (summaries, extraction, translation,
//!   questions over one or two documents), interleaved with second turns
//!   of those chats (a follow-up question after the target's own answer).
//!
//! Files: `corpus.json` (the manifest: target, vocabulary fingerprint,
//! settings, the command that builds it, and per shard its kind, prompt
//! range, counts, seconds and the SHA-256 of its file) and
//! `shard-NNNN.bin.gz`: gzip over the magic `SPECDCORPUS1` and then, per
//! sample, little-endian: source (u8, an index into `SOURCES`),
//! temperature (f32), seed (u64), prompt index (u32: the position in the
//! instruction stream, or the task's index), prompt length (u32), total
//! length (u32), then the token ids (u32 each).
//!
//! Invariants: a shard is written whole (a temporary file, then a rename)
//! and entered in the manifest only after; a rerun regenerates no shard
//! that is present and intact (its digest matches) and refuses a corpus
//! made for another vocabulary or with other settings; a shard whose file
//! is missing or altered is made again, with every shard after it (later
//! conversation shards read earlier ones); prompts and responses are
//! disjoint from the evaluation sets, as in `training_data`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::prompts::{NgramIndex, TrainingPrompt};
use super::{DataConfig, Generator, Job, Prompt, Sample};
use crate::error::{Result, SpecdError};
use crate::model::Model;
use crate::sampler::Rng;
use crate::speculative::drafter::Drafter;
use crate::speculative::driver::{EngineConfig, SyncDriver};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// Where a sample's prompt came from (the shard format stores the index).
pub const SOURCES: &[&str] = &[
    "chat-template",
    "code-stub",
    "role-play",
    "math",
    "reasoning",
    "passage",
    "follow-up",
];

const MAGIC: &[u8] = b"SPECDCORPUS1";

/// Second turns asked after the target's own answer.
pub const FOLLOW_UPS: &[&str] = &[
    "Can you make that shorter?",
    "Please explain the second point in more detail.",
    "Now put that as a bulleted list.",
    "What would someone who disagrees say about this?",
    "Give me one concrete example of that.",
    "Sum up your answer in a single sentence.",
    "Rewrite that so a ten-year-old could follow it.",
    "What mistakes do people often make here?",
    "Turn your answer into three quiz questions with their answers.",
    "Which part of this is most often misunderstood, and why?",
    "How would you explain this differently to an expert?",
    "What should I read or try next to learn more about it?",
];

/// How the corpus is generated (the manifest's `settings`: a corpus is
/// extended only with the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorpusSettings {
    /// Response tokens per shard.
    pub shard_tokens: usize,
    /// Most tokens per response.
    pub gen_max_tokens: usize,
    /// Temperature of the sampled responses.
    pub temperature: f32,
    pub seed: u64,
}

/// One shard in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub index: usize,
    /// `instructions` or `conversations`.
    pub kind: String,
    pub file: String,
    pub sha256: String,
    pub samples: usize,
    pub prompt_tokens: usize,
    pub response_tokens: usize,
    /// Instruction shards: the positions `[start, end)` of the instruction
    /// stream they queued.
    pub prompts: [usize; 2],
    /// Responses dropped for overlapping an evaluation text.
    pub dropped: usize,
    pub seconds: f64,
}

/// `corpus.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// The target's file name.
    pub target: String,
    /// `tokenizer::vocab_fingerprint` of the target's vocabulary.
    pub vocab_fingerprint: String,
    pub settings: CorpusSettings,
    /// The command that builds (and extends) this corpus.
    pub command: String,
    pub shards: Vec<ShardEntry>,
}

impl Manifest {
    pub fn response_tokens(&self) -> usize {
        self.shards.iter().map(|s| s.response_tokens).sum()
    }
}

/// One sample of the corpus and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct CorpusSample {
    /// Index into `SOURCES`.
    pub source: u8,
    pub temperature: f32,
    pub seed: u64,
    /// Position in the instruction stream, or the task's index.
    pub index: u32,
    pub sample: Sample,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> SpecdError {
    SpecdError::InvalidRequest(format!("{}: {why}", path.display()))
}

fn fingerprint(tok: &Tokenizer) -> String {
    crate::tokenizer::vocab_fingerprint((0..tok.vocab_size() as u32).map(|i| tok.id_to_token(i)))
}

fn source_index(s: &str) -> Result<u8> {
    SOURCES
        .iter()
        .position(|x| *x == s)
        .map(|i| i as u8)
        .ok_or_else(|| SpecdError::InvalidRequest(format!("corpus: unknown prompt source `{s}`")))
}

/// The shard's bytes before compression.
fn encode(samples: &[CorpusSample]) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    for c in samples {
        b.push(c.source);
        b.extend_from_slice(&c.temperature.to_le_bytes());
        b.extend_from_slice(&c.seed.to_le_bytes());
        b.extend_from_slice(&c.index.to_le_bytes());
        b.extend_from_slice(&(c.sample.prompt_len as u32).to_le_bytes());
        b.extend_from_slice(&(c.sample.tokens.len() as u32).to_le_bytes());
        for t in &c.sample.tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
    }
    b
}

fn decode(path: &Path, b: &[u8]) -> Result<Vec<CorpusSample>> {
    let rest = b
        .strip_prefix(MAGIC)
        .ok_or_else(|| bad(path, "not a specd corpus shard"))?;
    let mut r = rest;
    let mut take = |n: usize| -> Result<&[u8]> {
        if r.len() < n {
            return Err(bad(path, "shard ends inside a sample"));
        }
        let (a, b) = r.split_at(n);
        r = b;
        Ok(a)
    };
    let mut out = Vec::new();
    // The shard ends where a sample would start.
    while let Ok(src) = take(1) {
        let source = src[0];
        let u32_at = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let temperature = f32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
        let seed = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let index = u32_at(take(4)?);
        let prompt_len = u32_at(take(4)?) as usize;
        let len = u32_at(take(4)?) as usize;
        if prompt_len > len || source as usize >= SOURCES.len() {
            return Err(bad(path, "a sample's header is corrupt"));
        }
        let tokens = take(4 * len)?.chunks_exact(4).map(u32_at).collect();
        out.push(CorpusSample {
            source,
            temperature,
            seed,
            index,
            sample: Sample { tokens, prompt_len },
        });
    }
    Ok(out)
}

fn read_shard(dir: &Path, e: &ShardEntry) -> Result<Vec<CorpusSample>> {
    let path = dir.join(&e.file);
    let gz = std::fs::read(&path).map_err(|err| bad(&path, err))?;
    let digest = sha256(&gz);
    if digest != e.sha256 {
        return Err(bad(
            &path,
            format!("SHA-256 {digest} is not the manifest's {}", e.sha256),
        ));
    }
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .map_err(|err| bad(&path, err))?;
    decode(&path, &raw)
}

fn sha256(b: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(b))
}

fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join("corpus.json");
    match std::fs::read_to_string(&path) {
        Ok(t) => serde_json::from_str(&t)
            .map(Some)
            .map_err(|e| bad(&path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(bad(&path, e)),
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The corpus in `dir`, every shard checked against its digest and the
/// manifest against `tok`'s vocabulary.
pub fn load(dir: &Path, tok: &Tokenizer) -> Result<(Manifest, Vec<CorpusSample>)> {
    load_shards(dir, tok, None)
}

/// `load`, reading only the shards in `shards` (all with None); a range
/// that is empty or reaches past the manifest's shards is an error naming
/// both.
pub fn load_shards(
    dir: &Path,
    tok: &Tokenizer,
    shards: Option<std::ops::Range<usize>>,
) -> Result<(Manifest, Vec<CorpusSample>)> {
    let m = read_manifest(dir)?
        .ok_or_else(|| bad(dir, "no corpus.json here (made by `specd distill corpus`)"))?;
    if m.vocab_fingerprint != fingerprint(tok) {
        return Err(bad(
            dir,
            format!(
                "this corpus was made for another vocabulary (target `{}`)",
                m.target
            ),
        ));
    }
    let range = shards.unwrap_or(0..m.shards.len());
    if range.is_empty() || range.end > m.shards.len() {
        return Err(bad(
            dir,
            format!(
                "shards {}..{} asked for, but the corpus holds shards 0..{}",
                range.start,
                range.end,
                m.shards.len()
            ),
        ));
    }
    let mut out = Vec::new();
    for e in &m.shards[range] {
        out.extend(read_shard(dir, e)?);
    }
    Ok((m, out))
}

/// What `build` is asked for.
#[derive(Debug, Clone)]
pub struct CorpusConfig {
    pub out: PathBuf,
    /// Shards the corpus should hold when done (present ones are kept).
    pub shards: usize,
    /// Requests decoded together.
    pub concurrency: usize,
    pub settings: CorpusSettings,
    /// The target's file name (recorded).
    pub target_name: String,
    /// The command line recorded in the manifest.
    pub command: String,
}

/// Build (or extend) the corpus in `cfg.out` to `cfg.shards` shards.
pub fn build(model: &Arc<Model>, tok: &Arc<Tokenizer>, cfg: &CorpusConfig) -> Result<Manifest> {
    let dir = &cfg.out;
    std::fs::create_dir_all(dir)?;
    let fp = fingerprint(tok);
    let mut man = match read_manifest(dir)? {
        Some(m) => {
            if m.vocab_fingerprint != fp {
                return Err(bad(
                    dir,
                    format!("this corpus was made for another vocabulary (target `{}`): use another --out", m.target),
                ));
            }
            if m.settings != cfg.settings {
                return Err(bad(
                    dir,
                    format!(
                        "this corpus was made with other settings ({:?}): extend it with those, or use another --out",
                        m.settings
                    ),
                ));
            }
            m
        }
        None => Manifest {
            format: 1,
            target: cfg.target_name.clone(),
            vocab_fingerprint: fp,
            settings: cfg.settings.clone(),
            command: cfg.command.clone(),
            shards: Vec::new(),
        },
    };
    // Keep the intact prefix of shards.
    let mut have: Vec<Vec<CorpusSample>> = Vec::new();
    for e in &man.shards {
        match read_shard(dir, e) {
            Ok(s) => have.push(s),
            Err(err) => {
                eprintln!(
                    "specd distill corpus: {err}; shard {} and those after it are made again",
                    e.index
                );
                break;
            }
        }
    }
    man.shards.truncate(have.len());
    let eval = crate::datasets::evaluation_texts();
    let index = NgramIndex::new(eval.iter().map(String::as_str));
    let (stream, dropped_prompts) = super::prompts::varied_prompts(usize::MAX, 7, &index);
    let follow_ups: Vec<&str> = FOLLOW_UPS
        .iter()
        .copied()
        .filter(|f| index.shared(f).is_none())
        .collect();
    eprintln!(
        "specd distill corpus: an instruction stream of {} prompts ({dropped_prompts} dropped for sharing an 8-gram with Spec-Bench or HumanEval)",
        stream.len()
    );
    if stream.is_empty() {
        return Err(bad(dir, "no training prompts survived the overlap check"));
    }
    let s = &cfg.settings;
    let data_cfg = DataConfig {
        gen_tokens: s.shard_tokens,
        gen_max_tokens: s.gen_max_tokens,
        temperature: s.temperature,
        sampled_fraction: 0.5,
        concurrency: cfg.concurrency,
        seed: s.seed,
        prompt_ids: Vec::new(),
        mix: super::prompts::PromptMix::Varied,
        corpus: None,
        corpus_shards: None,
    };
    let mut ec = EngineConfig::for_model(model);
    ec.scheduler.max_running = cfg.concurrency.max(1);
    ec.scheduler.max_waiting = usize::MAX;
    let mut engine = SyncDriver::new(model.clone(), Some(tok.clone()), ec, Drafter::new());
    let per_shard = s.shard_tokens / (s.gen_max_tokens / 4).max(1) + 8;
    while man.shards.len() < cfg.shards {
        let k = man.shards.len();
        let t0 = std::time::Instant::now();
        let bar = indicatif::ProgressBar::new(s.shard_tokens as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(&format!(
                "shard {k}: {{bar:40}} {{pos}}/{{len}} target tokens  {{per_sec}}  ~{{eta}} left"
            ))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut gen = Generator {
            engine: &mut engine,
            max_prompt: model.config.max_seq_len / 2,
            tok,
            cfg: &data_cfg,
            bar: &bar,
            evaluation: &index,
            dropped: 0,
        };
        let instructions = k % 2 == 0;
        // Each job's provenance: (source, prompt index).
        let mut prov: Vec<(u8, u32)> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        let mut range = [0usize; 2];
        if instructions {
            let start = man
                .shards
                .iter()
                .filter(|e| e.kind == "instructions")
                .map(|e| e.prompts[1])
                .max()
                .unwrap_or(0);
            range = [start, start + per_shard];
            for g in start..start + per_shard {
                let p: &TrainingPrompt = &stream[g % stream.len()];
                let first_pass = g < stream.len();
                jobs.push(Job {
                    prompt: Prompt::Text(p.text.clone(), p.chat),
                    temperature: if first_pass && g % 2 == 0 {
                        0.0
                    } else {
                        s.temperature
                    },
                    seed: s.seed.wrapping_add(g as u64),
                });
                prov.push((source_index(p.source)?, g as u32));
            }
        } else {
            // The chats answered in the instruction shards so far.
            let chats: Vec<&CorpusSample> = have
                .iter()
                .zip(&man.shards)
                .filter(|(_, e)| e.kind == "instructions")
                .flat_map(|(s, _)| s.iter())
                .filter(|c| stream[c.index as usize % stream.len()].chat)
                .collect();
            if chats.is_empty() {
                return Err(bad(
                    dir,
                    "no chat answers in the earlier shards to build on",
                ));
            }
            let answer =
                |c: &CorpusSample| tok.decode(&c.sample.tokens[c.sample.prompt_len..], true);
            let passages: Vec<String> = chats.iter().map(|c| answer(c)).collect::<Result<_>>()?;
            let tasks = super::prompts::passage_prompts(
                &passages,
                per_shard / 2 + 1,
                110,
                s.seed ^ 0xC0DE ^ ((k as u64) << 16),
                &index,
            )
            .0;
            let mut rng = Rng::new(s.seed ^ 0xF011 ^ ((k as u64) << 20));
            let mut t = tasks.into_iter().enumerate();
            for j in 0..per_shard {
                let seed = s.seed.wrapping_add(((k as u64) << 32) + j as u64);
                let temperature = if j % 4 < 2 { 0.0 } else { s.temperature };
                if j % 2 == 0 {
                    if let Some((ti, task)) = t.next() {
                        jobs.push(Job {
                            prompt: Prompt::Text(task.text, true),
                            temperature,
                            seed,
                        });
                        prov.push((source_index("passage")?, ti as u32));
                        continue;
                    }
                }
                if follow_ups.is_empty() {
                    continue;
                }
                let c = chats[(rng.next_u64() % chats.len() as u64) as usize];
                let q = follow_ups[(rng.next_u64() % follow_ups.len() as u64) as usize];
                let first = &stream[c.index as usize % stream.len()].text;
                jobs.push(Job {
                    prompt: Prompt::Chat(vec![
                        ChatMessage::user(first.clone()),
                        ChatMessage::new("assistant", answer(c)?),
                        ChatMessage::user(q),
                    ]),
                    temperature,
                    seed,
                });
                prov.push((source_index("follow-up")?, c.index));
            }
        }
        let done = gen.run_jobs(&jobs, s.shard_tokens)?;
        let dropped = gen.dropped;
        bar.finish_and_clear();
        let samples: Vec<CorpusSample> = done
            .into_iter()
            .map(|(j, sample)| CorpusSample {
                source: prov[j].0,
                temperature: jobs[j].temperature,
                seed: jobs[j].seed,
                index: prov[j].1,
                sample,
            })
            .collect();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&encode(&samples))?;
        let gz = gz.finish()?;
        let file = format!("shard-{k:04}.bin.gz");
        write_atomic(&dir.join(&file), &gz)?;
        let entry = ShardEntry {
            index: k,
            kind: if instructions {
                "instructions"
            } else {
                "conversations"
            }
            .into(),
            file,
            sha256: sha256(&gz),
            samples: samples.len(),
            prompt_tokens: samples.iter().map(|c| c.sample.prompt_len).sum(),
            response_tokens: samples
                .iter()
                .map(|c| c.sample.tokens.len() - c.sample.prompt_len)
                .sum(),
            prompts: range,
            dropped,
            seconds: (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        };
        eprintln!(
            "specd distill corpus: shard {k} ({}): {} samples, {} response tokens, {} KiB, {:.0} s",
            entry.kind,
            entry.samples,
            entry.response_tokens,
            gz.len() / 1024,
            entry.seconds
        );
        man.shards.push(entry);
        have.push(samples);
        man.command = cfg
            .command
            .replace("--shards N", &format!("--shards {}", man.shards.len()));
        let text = serde_json::to_string_pretty(&man).map_err(|e| bad(dir, e))?;
        write_atomic(&dir.join("corpus.json"), text.as_bytes())?;
    }
    Ok(man)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_and_corruption_is_caught() {
        let samples = vec![
            CorpusSample {
                source: 3,
                temperature: 0.7,
                seed: 99,
                index: 12,
                sample: Sample {
                    tokens: vec![1, 2, 3, 70_000],
                    prompt_len: 2,
                },
            },
            CorpusSample {
                source: 6,
                temperature: 0.0,
                seed: 1,
                index: 0,
                sample: Sample {
                    tokens: vec![5],
                    prompt_len: 1,
                },
            },
        ];
        let b = encode(&samples);
        let p = Path::new("x");
        assert_eq!(decode(p, &b).unwrap(), samples);
        assert!(decode(p, &b[..b.len() - 2]).is_err());
        assert!(decode(p, &b[1..]).is_err());
        let mut bad_len = b.clone();
        // The first sample's prompt length past its total length.
        bad_len[MAGIC.len() + 17] = 9;
        assert!(decode(p, &bad_len).is_err());
    }
}

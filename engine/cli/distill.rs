//! `specd distill`: train proposers for a target by self-distillation.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

use specd::model;

#[derive(Subcommand)]
pub enum DistillCmd {
    /// Train a small draft model for a target by self-distillation.
    Draft(DistillArgs),
    /// Train an EAGLE-3 draft head for a target by self-distillation
    /// (written in the public EAGLE-3 layout).
    Eagle(EagleArgs),
    /// Train a multi-token-prediction module for a target without one
    /// (written as the target's next layer in the DeepSeek-V3 MTP names,
    /// for the `mtp` plugin); the options are `eagle`'s (feature layers
    /// aside: MTP reads the final-normed state).
    Mtp(EagleArgs),
    /// Train Medusa-1 heads for a frozen target by self-distillation
    /// (public Medusa tensor names; read out through the target's head).
    Medusa(MedusaArgs),
    /// Train a DFlash block drafter for a target by self-distillation: a
    /// few layers over the target's fused features draft a whole block in
    /// one forward (written in z-lab's layout, for the `dflash` plugin).
    Dflash(DflashArgs),
    /// Measure why a trained EAGLE-3 head or MTP module is (not) accepted:
    /// per TTT step of the training graph and through the plugin's
    /// inference path, on the training and validation texts a trainer
    /// cached (prints markdown tables).
    Diagnose(DiagnoseArgs),
    /// Build (or extend) a training corpus: the target's answers to
    /// instruction prompts and conversations over them, disjoint from the
    /// evaluation sets, in resumable shards of compressed token ids with
    /// each sample's provenance (`corpus.json` holds each shard's SHA-256
    /// and the command that builds it); trainers read it with `--corpus`.
    Corpus(CorpusArgs),
    /// Measure the ceiling a draft vocabulary puts on acceptance: the
    /// share of a target's plain outputs (the JSONL of `specd generate
    /// --prompts`, with `token_ids` and `category`) inside each head's draft
    /// vocabulary and inside the vocabulary a trainer would choose from a
    /// corpus at each size (prints a markdown table).
    Coverage(CoverageArgs),
}

#[derive(Args)]
pub struct CoverageArgs {
    /// Target model (default: the embedded SmolLM2): its vocabulary and
    /// EOS ids.
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// The target's outputs to measure, e.g. `specd generate --prompts
    /// FILE --chat > OUT` over an evaluation set's prompts (a row per
    /// `category`; lines without one count toward the `all` row only).
    #[arg(long)]
    pub outputs: PathBuf,
    /// A trained head, module or drafter directory (its model.safetensors'
    /// `d2t`); repeatable.
    #[arg(long)]
    pub head: Vec<PathBuf>,
    /// A training corpus (`distill corpus`): also measure the vocabulary a
    /// trainer chooses from all its shards at each of `--sizes`.
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// Draft vocabulary sizes measured with `--corpus`.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192,16384,32768",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub sizes: Vec<u32>,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct CorpusArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Corpus directory (created; shards already there are kept).
    #[arg(long)]
    pub out: PathBuf,
    /// Shards the corpus holds when this run ends.
    #[arg(long)]
    pub shards: usize,
    /// Response tokens per shard.
    #[arg(long, default_value_t = 100_000)]
    pub shard_tokens: usize,
    /// Most tokens per response.
    #[arg(long, default_value_t = 384)]
    pub gen_max_tokens: usize,
    /// Temperature of the sampled responses.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Requests decoded together.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Args)]
pub struct DiagnoseArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// The head's directory (config.json, model.safetensors).
    #[arg(long)]
    pub head: PathBuf,
    /// A `distill eagle`/`mtp` run's train/ directory (samples.json,
    /// features.safetensors) made with default data settings.
    #[arg(long)]
    pub data: PathBuf,
    /// Training-graph steps to unroll.
    #[arg(long, default_value_t = 4)]
    pub ttt_steps: usize,
    /// Training samples measured (the validation split is measured whole).
    #[arg(long, default_value_t = 240)]
    pub train_samples: usize,
    /// Samples per split run through the plugin's inference path (0: skip).
    #[arg(long, default_value_t = 80)]
    pub chain_samples: usize,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long)]
    pub threads: Option<usize>,
}

/// The training data's prompts (every distill command).
#[derive(Args)]
pub struct PromptArgs {
    /// Training prompts: `templated` (instructions and code stubs, the
    /// data of the shipped heads) or `varied` (those plus role-play,
    /// arithmetic and reasoning, then tasks over passages the target wrote:
    /// summaries, extraction, translation, questions over documents).
    #[arg(long, value_parser = specd::distill::prompts::PromptMix::parse, default_value = "templated")]
    pub prompts: specd::distill::prompts::PromptMix,
    /// Train on a corpus made by `specd distill corpus` (this directory)
    /// instead of generating text: its samples in order, up to
    /// `--gen-tokens` response tokens (0: all of them).
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// With `--corpus`: train on its shards A..B only (A included, B not;
    /// e.g. 0..6, the shards the shipped heads were trained on, or shards
    /// a head has not seen, with `distill eagle|mtp --init`).
    #[arg(long, value_parser = parse_shard_range)]
    pub corpus_shards: Option<std::ops::Range<usize>>,
}

impl PromptArgs {
    /// `--corpus-shards` only with `--corpus`.
    fn check(&self) -> Result<()> {
        if self.corpus_shards.is_some() && self.corpus.is_none() {
            anyhow::bail!("--corpus-shards needs --corpus (the corpus whose shards to read)");
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct MedusaArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Output directory: config.json and model.safetensors (the heads),
    /// train/ (samples, final-normed states, checkpoint); training resumes
    /// from a checkpoint found there, and reuses samples and states a
    /// `distill eagle` run left in a train/ directory copied there.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Residual blocks per head.
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Rows of the output (most frequent response tokens).
    #[arg(long, default_value_t = 4096)]
    pub draft_vocab: usize,
    #[arg(long, default_value_t = 3.0)]
    pub epochs: f64,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Tokens per training batch.
    #[arg(long, default_value_t = 4096)]
    pub batch_tokens: usize,
    /// Target-generated response tokens to train on.
    #[arg(long, default_value_t = 240000)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 25)]
    pub checkpoint_every: usize,
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Stop after this many steps (the schedule stays that of --epochs).
    #[arg(long, default_value_t = 0)]
    pub stop_after: usize,
    #[command(flatten)]
    pub data: PromptArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Args)]
pub struct EagleArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Output directory: config.json and model.safetensors (the head),
    /// train/ (samples, features, checkpoint); training resumes from a
    /// checkpoint found there.
    #[arg(long)]
    pub out: PathBuf,
    /// Rows of the head's output layer (most frequent response tokens).
    #[arg(long, default_value_t = 4096)]
    pub draft_vocab: usize,
    #[arg(long, default_value_t = 1024)]
    pub intermediate: usize,
    /// Unrolled training-time-test steps.
    #[arg(long, default_value_t = 4)]
    pub ttt_steps: usize,
    #[arg(long, default_value_t = 2.0)]
    pub epochs: f64,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Padded tokens per training batch.
    #[arg(long, default_value_t = 2048)]
    pub batch_tokens: usize,
    /// Target-generated response tokens to train on.
    #[arg(long, default_value_t = 240000)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: usize,
    #[arg(long, default_value_t = 40)]
    pub warmup: usize,
    /// Stop after this many steps (the schedule stays that of --epochs).
    #[arg(long, default_value_t = 0)]
    pub stop_after: usize,
    /// Start fc random instead of as the identity on the highest feature
    /// layer (the logit-lens start the shipped head was trained from).
    #[arg(long)]
    pub fc_random: bool,
    /// Scale fc's start so the fused state has unit RMS on the training
    /// features (`--fc-unit false`: the raw scale of the first heads).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub fc_unit: bool,
    /// Standard deviation of the start of o_proj and down_proj.
    #[arg(long, default_value_t = 0.002)]
    pub out_std: f32,
    /// Leave positions whose target is outside the draft vocabulary out of
    /// the loss (`--drop-oov false`: renormalise them in).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub drop_oov: bool,
    /// Start the attention focused on each row's own key with this gain
    /// (0: off; EAGLE-3 heads only).
    #[arg(long, default_value_t = 1.0)]
    pub self_attn_init: f32,
    /// Hidden indices of the layers the head reads, comma-separated
    /// (default: EAGLE-3's, the residual stream entering layers 2, L/2 and
    /// L-3; L names the final-normed state).
    #[arg(long, value_delimiter = ',')]
    pub feature_layers: Vec<usize>,
    /// EAGLE-3 heads: start the layer's residual stream from the
    /// normalised state (hidden_norm(g)) at every TTT step, as an MTP
    /// module re-normalises the state it is given (a specd extension,
    /// recorded in the head's config.json).
    #[arg(long)]
    pub normed_residual: bool,
    #[command(flatten)]
    pub data: PromptArgs,
    /// Start from the head (or MTP module) in this directory, its weights
    /// and its draft vocabulary, instead of a fresh start: training
    /// continues it on this run's data (e.g.
    /// proposers/mtp/modules/smollm2-135m-instruct).
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
}

/// `A..B` (B > A) as a range of shard indices.
fn parse_shard_range(s: &str) -> std::result::Result<std::ops::Range<usize>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("`{s}`: expected A..B, e.g. 6..12"))?;
    let parse = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("`{s}`: `{x}` is not a shard index"))
    };
    let (a, b) = (parse(a)?, parse(b)?);
    if b <= a {
        return Err(format!("`{s}`: the range holds no shard (B must exceed A)"));
    }
    Ok(a..b)
}

#[derive(Args)]
pub struct DflashArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Output directory: config.json and model.safetensors (the drafter),
    /// train/ (samples, features, checkpoint; a `distill eagle` run's
    /// train/ copied here serves when the layers match); training resumes
    /// from a checkpoint found there.
    #[arg(long)]
    pub out: PathBuf,
    /// Draft layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 1024)]
    pub intermediate: usize,
    /// Rows of a block: the anchor token and block_size - 1 masks (the
    /// most tokens one forward drafts, minus one).
    #[arg(long, default_value_t = 8)]
    pub block_size: usize,
    /// 0-based target layers whose outputs are fused, comma-separated
    /// (default: those EAGLE-3 reads).
    #[arg(long, value_delimiter = ',')]
    pub target_layer_ids: Vec<usize>,
    /// Rows of the drafter's output layer (most frequent response tokens).
    #[arg(long, default_value_t = 4096)]
    pub draft_vocab: usize,
    /// Anchors (blocks) per sample and step.
    #[arg(long, default_value_t = 24)]
    pub anchors: usize,
    /// Loss weight decay over block slots: exp(-(k - 1) / gamma).
    #[arg(long, default_value_t = 4.0)]
    pub gamma: f64,
    #[arg(long, default_value_t = 2.0)]
    pub epochs: f64,
    #[arg(long, default_value_t = 6e-4)]
    pub lr: f64,
    /// Padded context tokens per training batch.
    #[arg(long, default_value_t = 2048)]
    pub batch_tokens: usize,
    /// Target-generated response tokens to train on.
    #[arg(long, default_value_t = 240000)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: usize,
    #[arg(long, default_value_t = 40)]
    pub warmup: usize,
    /// Stop after this many steps (the schedule stays that of --epochs).
    #[arg(long, default_value_t = 0)]
    pub stop_after: usize,
    #[command(flatten)]
    pub data: PromptArgs,
    /// Start from the drafter in this directory, its weights and its draft
    /// vocabulary, instead of a fresh start: training continues it on this
    /// run's data (e.g. proposers/dflash/drafters/smollm2-135m-instruct
    /// with --corpus-shards it has not seen).
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Args)]
pub struct DistillArgs {
    /// Target model (default: the embedded SmolLM2).
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Output directory (config.json, model.safetensors, state.json;
    /// tokenizer.json for a plain draft; train/ with the samples, target
    /// states and checkpoint of a compact one, which may be a copy of a
    /// `distill eagle` run's train/); training resumes from a checkpoint
    /// found there.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 768)]
    pub intermediate: usize,
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 700)]
    pub steps: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Target-generated response tokens to train on.
    #[arg(long, default_value_t = 240000)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: usize,
    /// Rows of the output head (most frequent response tokens); the draft
    /// is then compact: it reads the target's embedding through a learned
    /// projection and learns the target's distribution. 0: a plain Llama
    /// with its own tied full-vocabulary embedding, trained on the
    /// target's sampled text.
    #[arg(long, default_value_t = 4096)]
    pub draft_vocab: usize,
    /// Compact drafts: loss weight of positions inside the prompt.
    #[arg(long, default_value_t = 0.5)]
    pub prompt_weight: f32,
    /// Compact drafts: PARD-style parallel drafting of up to K tokens per
    /// forward (a learned mask embedding; every mask depth trains beside
    /// the next-token objective). The draft plugin uses it with
    /// `mode = "parallel"`. 0: autoregressive only.
    #[arg(long, default_value_t = 0)]
    pub parallel: usize,
    /// Compact drafts: start from this compact draft's weights and draft
    /// vocabulary (e.g. proposers/draft/models/smollm2-135m-instruct).
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[command(flatten)]
    pub data: PromptArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(what: DistillCmd) -> Result<()> {
    match what {
        DistillCmd::Corpus(a) => {
            let target = match &a.target {
                Some(t) => specd::fetch::resolve_model(t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            let m = std::sync::Arc::new(model::load_model(&target, threads)?);
            let tok = std::sync::Arc::new(specd::tokenizer::Tokenizer::for_model(&target)?);
            let settings = specd::distill::corpus::CorpusSettings {
                shard_tokens: a.shard_tokens,
                gen_max_tokens: a.gen_max_tokens,
                temperature: a.temperature,
                seed: a.seed,
            };
            let mut command = format!(
                "specd distill corpus --out {} --shards N --shard-tokens {} --gen-max-tokens {} --temperature {} --seed {}",
                a.out.display(),
                a.shard_tokens,
                a.gen_max_tokens,
                a.temperature,
                a.seed
            );
            if let Some(t) = &a.target {
                command.push_str(&format!(" --target {}", t.display()));
            }
            let cfg = specd::distill::corpus::CorpusConfig {
                out: a.out.clone(),
                shards: a.shards,
                concurrency: a.concurrency,
                settings,
                target_name: target
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                command,
            };
            let man = specd::distill::corpus::build(&m, &tok, &cfg)?;
            println!(
                "{}: {} shards, {} response tokens",
                a.out.display(),
                man.shards.len(),
                man.response_tokens()
            );
            Ok(())
        }
        DistillCmd::Draft(a) => {
            a.data.check()?;
            let target = match a.target {
                Some(t) => specd::fetch::resolve_model(&t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            // A compact draft trains on the data `distill eagle`, `mtp` and
            // `medusa` generate (same prompts, lengths and sampling), so
            // their train/ directory can be shared.
            let data = if a.draft_vocab > 0 {
                let e = specd::distill::eagle::EagleConfig::default();
                (
                    e.gen_max_tokens,
                    e.temperature,
                    e.sampled_fraction,
                    e.concurrency,
                )
            } else {
                let d = specd::distill::DistillConfig::default();
                (
                    d.gen_max_tokens,
                    d.temperature,
                    d.sampled_fraction,
                    d.concurrency,
                )
            };
            let cfg = specd::distill::DistillConfig {
                gen_max_tokens: data.0,
                temperature: data.1,
                sampled_fraction: data.2,
                concurrency: data.3,
                layers: a.layers,
                hidden: a.hidden,
                heads: a.heads,
                intermediate: a.intermediate,
                seq_len: a.seq_len,
                batch: a.batch,
                steps: a.steps,
                lr: a.lr,
                gen_tokens: a.gen_tokens,
                checkpoint_every: a.checkpoint_every,
                draft_vocab: a.draft_vocab,
                prompt_weight: a.prompt_weight,
                parallel: a.parallel,
                init: a.init.clone(),
                seed: a.seed,
                prompts: a.data.prompts,
                corpus: a.data.corpus.clone(),
                corpus_shards: a.data.corpus_shards.clone(),
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            let out = specd::distill::distill(&target, &a.out, &cfg, threads)?;
            println!("{}", out.display());
            Ok(())
        }
        DistillCmd::Diagnose(a) => {
            let target = match a.target {
                Some(t) => specd::fetch::resolve_model(&t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            let cfg = specd::distill::diagnose::DiagnoseConfig {
                ttt: a.ttt_steps,
                train_samples: a.train_samples,
                chain_samples: a.chain_samples,
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            let r = specd::distill::diagnose::diagnose(&target, &a.head, &a.data, &cfg, threads)?;
            if let Some(j) = &a.json {
                std::fs::write(j, serde_json::to_string_pretty(&r)?)?;
            }
            println!("{}", r.markdown());
            Ok(())
        }
        DistillCmd::Coverage(a) => {
            use specd::distill::coverage::{coverage, read_outputs, Vocab};
            let target = match &a.target {
                Some(t) => specd::fetch::resolve_model(t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            let m = model::load_model(&target, 1)?;
            let (vocab, eos) = (m.config.vocab_size, m.config.eos_token_ids.clone());
            let outputs = read_outputs(&a.outputs, vocab)?;
            let samples: Vec<_> = match &a.corpus {
                Some(dir) => {
                    let tok = specd::tokenizer::Tokenizer::for_model(&target)?;
                    let (_, all) = specd::distill::corpus::load_shards(dir, &tok, None)?;
                    all.into_iter().map(|c| c.sample).collect()
                }
                None => Vec::new(),
            };
            let mut vocabs: Vec<Vocab> = a.head.iter().cloned().map(Vocab::Head).collect();
            if a.corpus.is_some() {
                for &n in &a.sizes {
                    vocabs.push(Vocab::Top {
                        n: n as usize,
                        samples: &samples,
                    });
                }
            }
            if vocabs.is_empty() {
                anyhow::bail!(
                    "distill coverage: give --head DIR or --corpus DIR (nothing to measure)"
                );
            }
            let r = coverage(&outputs, &vocabs, vocab, &eos)?;
            if let Some(j) = &a.json {
                std::fs::write(j, serde_json::to_string_pretty(&r)?)?;
            }
            println!("{}", r.markdown());
            Ok(())
        }
        DistillCmd::Eagle(a) => run_eagle(a, false),
        DistillCmd::Dflash(a) => {
            a.data.check()?;
            let target = match a.target {
                Some(t) => specd::fetch::resolve_model(&t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            let cfg = specd::distill::dflash::DflashTrainConfig {
                layers: a.layers,
                intermediate: a.intermediate,
                block_size: a.block_size,
                target_layer_ids: a.target_layer_ids,
                draft_vocab: a.draft_vocab,
                anchors: a.anchors,
                gamma: a.gamma,
                epochs: a.epochs,
                lr: a.lr,
                batch_tokens: a.batch_tokens,
                gen_tokens: a.gen_tokens,
                checkpoint_every: a.checkpoint_every,
                warmup: a.warmup,
                stop_after: a.stop_after,
                seed: a.seed,
                prompts: a.data.prompts,
                corpus: a.data.corpus.clone(),
                corpus_shards: a.data.corpus_shards.clone(),
                init: a.init.clone(),
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            specd::distill::dflash::distill_dflash(&target, &a.out, &cfg, threads)?;
            print_weights(&a.out)
        }
        DistillCmd::Mtp(a) => run_eagle(a, true),
        DistillCmd::Medusa(a) => {
            a.data.check()?;
            let target = match a.target {
                Some(t) => specd::fetch::resolve_model(&t)?,
                None => specd::fetch::ensure_default_model()?,
            };
            let cfg = specd::distill::medusa::MedusaTrainConfig {
                heads: a.heads,
                layers: a.layers,
                draft_vocab: a.draft_vocab,
                epochs: a.epochs,
                lr: a.lr,
                batch_tokens: a.batch_tokens,
                gen_tokens: a.gen_tokens,
                checkpoint_every: a.checkpoint_every,
                warmup: a.warmup,
                stop_after: a.stop_after,
                seed: a.seed,
                prompts: a.data.prompts,
                corpus: a.data.corpus.clone(),
                corpus_shards: a.data.corpus_shards.clone(),
                ..Default::default()
            };
            let threads = a.threads.unwrap_or_else(model::llama::default_threads);
            specd::distill::medusa::distill_medusa(&target, &a.out, &cfg, threads)?;
            print_weights(&a.out)
        }
    }
}

/// Print a trained head's weights file and its SHA-256.
fn print_weights(out: &std::path::Path) -> Result<()> {
    let weights = out.join("model.safetensors");
    println!(
        "{}  sha256 {}",
        weights.display(),
        specd::fetch::sha256_file(&weights)?
    );
    Ok(())
}

/// `distill eagle`, or `distill mtp` (`mtp`: the same trainer and options,
/// an MTP module instead of an EAGLE-3 head).
fn run_eagle(a: EagleArgs, mtp: bool) -> Result<()> {
    a.data.check()?;
    if mtp && a.normed_residual {
        anyhow::bail!(
            "--normed-residual is for EAGLE-3 heads: an MTP module re-normalises its input already"
        );
    }
    let target = match a.target {
        Some(t) => specd::fetch::resolve_model(&t)?,
        None => specd::fetch::ensure_default_model()?,
    };
    let cfg = specd::distill::eagle::EagleConfig {
        draft_vocab: a.draft_vocab,
        intermediate: a.intermediate,
        ttt_steps: a.ttt_steps,
        epochs: a.epochs,
        lr: a.lr,
        batch_tokens: a.batch_tokens,
        gen_tokens: a.gen_tokens,
        checkpoint_every: a.checkpoint_every,
        warmup: a.warmup,
        stop_after: a.stop_after,
        fc_identity: !a.fc_random,
        fc_unit: a.fc_unit,
        out_std: a.out_std,
        drop_oov: a.drop_oov,
        self_attn_init: a.self_attn_init,
        feature_layers: a.feature_layers,
        normed_residual: a.normed_residual,
        seed: a.seed,
        prompts: a.data.prompts,
        corpus: a.data.corpus.clone(),
        corpus_shards: a.data.corpus_shards.clone(),
        init: a.init.clone(),
        mtp,
        ..Default::default()
    };
    let threads = a.threads.unwrap_or_else(model::llama::default_threads);
    specd::distill::eagle::distill_eagle(&target, &a.out, &cfg, threads)?;
    print_weights(&a.out)
}

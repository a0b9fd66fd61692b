//! Out-of-tree builds (the example plugin, the fixture plugins) and tiny
//! distill helpers.

use super::*;

/// The cargo target dir these tests run from (`<target>/release/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Build an out-of-tree workspace (offline, into a separate target dir so it
/// never contends with the outer cargo) and return its release dir.
pub fn build_out_of_tree(manifest_dir: &str) -> PathBuf {
    let dir = repo_root().join(manifest_dir);
    let target = target_dir().join("out-of-tree");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["build", "--release", "--offline", "--quiet"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "building {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("release")
}

/// The fixture plugins of `tests/fixtures/plugins`, built.
pub fn build_fixture_plugins() -> PathBuf {
    build_out_of_tree("tests/fixtures/plugins")
}

/// A `distill draft` configuration small enough for a test: 1 layer,
/// hidden 32, `steps` steps on the target's answers to a few id prompts
/// (ids below 12, so any tiny target takes them); `dv` > 0: compact.
pub fn tiny_distill_config(steps: usize, dv: usize) -> specd::distill::DistillConfig {
    specd::distill::DistillConfig {
        layers: 1,
        hidden: 32,
        heads: 2,
        intermediate: 64,
        seq_len: 16,
        batch: 4,
        steps,
        lr: 1e-2,
        gen_tokens: 400,
        gen_max_tokens: 40,
        checkpoint_every: 10,
        prompt_ids: vec![vec![5, 9, 3], vec![4, 1, 2, 3], vec![7, 7, 8]],
        draft_vocab: dv,
        ..Default::default()
    }
}

/// Train a compact draft with a draft vocabulary of `dv` (see
/// `tiny_distill_config`) for the target at `target` into `out`.
pub fn train_tiny_compact(
    target: &Path,
    out: &Path,
    dv: usize,
    steps: usize,
) -> specd::distill::State {
    specd::distill::distill(target, out, &tiny_distill_config(steps, dv), 2).unwrap();
    serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap()
}

/// Rewrite the safetensors file at `path` with `edit` applied to its
/// tensors (name, shape, data), e.g. to drop or reshape one.
pub fn rewrite_safetensors(
    path: &Path,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>, specd::model::tensor_file::TensorData)>),
) {
    use specd::model::tensor_file::{self, TensorData, TensorFile};
    let f = TensorFile::read(path).unwrap();
    let names: Vec<String> = f.names().map(str::to_string).collect();
    let mut all = Vec::new();
    for n in names {
        let shape = f.shape(&n).unwrap().to_vec();
        let data = match f.i64(&n) {
            Ok(v) => TensorData::I64(v),
            Err(_) => TensorData::F32(f.f32(&n).unwrap()),
        };
        all.push((n, shape, data));
    }
    edit(&mut all);
    tensor_file::write(path, &all).unwrap();
}

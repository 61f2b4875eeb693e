//! The boundary invariants of `docs/ARCHITECTURE.md` that a reading of the sources can hold: each test here
//! fails when the code crosses a line the document draws.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every `.rs` file below `dir` (relative to the workspace root), as workspace-relative paths.
fn rust_files(dir: &str) -> Vec<String> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join(dir), &mut out);
    let mut rel: Vec<String> =
        out.iter().map(|p| p.strip_prefix(root()).unwrap().to_string_lossy().into_owned()).collect();
    rel.sort();
    rel
}

/// The package names under `[dependencies]` of a crate's `Cargo.toml` (not dev- or build-dependencies).
fn dependencies(manifest: &str) -> BTreeSet<String> {
    let text = read(manifest);
    let mut in_deps = false;
    let mut deps = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once(['=', '.']) {
                deps.insert(name.trim().to_string());
            }
        }
    }
    deps
}

/// Source text without comment lines (docs may name anything).
fn code_of(text: &str) -> String {
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

#[test]
fn crate_dependencies_point_down_the_layers() {
    let ours = ["accel-nn", "ddp-core", "accel", "trainer"];
    let of = |krate: &str| -> BTreeSet<String> {
        let deps = dependencies(&format!("crates/{krate}/Cargo.toml"));
        deps.into_iter().filter(|d| ours.contains(&d.as_str())).collect()
    };
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(of("accel-nn"), set(&[]), "accel-nn depends on candle only");
    assert_eq!(of("ddp-core"), set(&[]), "ddp-core depends on candle only");
    assert_eq!(of("accel"), set(&["accel-nn", "ddp-core"]));
    assert_eq!(of("trainer"), set(&["accel"]), "the Trainer reaches the lower levels through accel only");
    // The words of a wrong config file: a leaf, used by the two readers of config files only.
    let workspace = ["accel-nn", "ddp-core", "accel", "trainer", "accel-cli", "config-errors"];
    assert!(dependencies("crates/config-errors/Cargo.toml").iter().all(|d| !workspace.contains(&d.as_str())));
    for (krate, uses) in
        [("accel-nn", false), ("ddp-core", false), ("accel", false), ("trainer", true), ("accel-cli", true)]
    {
        let deps = dependencies(&format!("crates/{krate}/Cargo.toml"));
        assert_eq!(deps.contains("config-errors"), uses, "{krate} and config-errors");
    }
    // The kernels' dependencies are accel-nn's alone.
    let ddp = dependencies("crates/ddp-core/Cargo.toml");
    for gone in ["gemm", "safetensors", "serde_json"] {
        assert!(!ddp.contains(gone), "ddp-core depends on {gone}, which only the computation (accel-nn) needs");
    }
}

#[test]
fn ddp_core_communicates_and_accel_nn_does_not() {
    for file in rust_files("crates/ddp-core/src") {
        let code = code_of(&read(&file));
        for word in ["gemm::", "safetensors::", "serde_json::", "accel_nn", "accel::", "trainer::"] {
            assert!(!code.contains(word), "{file} uses {word}: ddp-core only communicates");
        }
    }
    for file in rust_files("crates/accel-nn/src") {
        let code = code_of(&read(&file));
        for word in ["ddp_core", "ProcessGroup", "accel::", "trainer::"] {
            assert!(!code.contains(word), "{file} uses {word}: accel-nn communicates with nothing");
        }
    }
}

/// The top-level module of `crates/accel/src` a file belongs to (`step/gradients.rs` → `step`).
fn top_module(file: &str) -> String {
    let rel = file.strip_prefix("crates/accel/src/").unwrap();
    rel.split('/').next().unwrap().trim_end_matches(".rs").to_string()
}

/// Which top-level modules of accel each module names (`crate::x`, or an item the crate root re-exports from
/// `x`), test modules excluded.
fn accel_module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let lib = code_of(&read("crates/accel/src/lib.rs"));
    let modules: BTreeSet<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            l.strip_prefix("mod ").map(|m| m.trim_end_matches(';').to_string())
        })
        .collect();
    // `pub use module::{A, B};` at the root: A and B lead to `module`.
    let mut reexported = BTreeMap::new();
    for l in lib.lines().map(str::trim) {
        let Some(rest) = l.strip_prefix("pub use ").or_else(|| l.strip_prefix("pub(crate) use ")) else { continue };
        let Some((module, items)) = rest.split_once("::") else { continue };
        if !modules.contains(module) {
            continue;
        }
        for item in items.split(|c: char| !c.is_alphanumeric() && c != '_').filter(|s| !s.is_empty()) {
            reexported.insert(item.to_string(), module.to_string());
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for file in rust_files("crates/accel/src") {
        let from = top_module(&file);
        if !modules.contains(&from) || file.ends_with("/tests.rs") {
            continue;
        }
        let text = read(&file);
        let code = code_of(text.split("#[cfg(test)]\nmod tests {").next().unwrap());
        let mut named = BTreeSet::new();
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                named.extend(inner.split(',').map(|p| p.trim().split("::").next().unwrap().to_string()));
            } else {
                named.insert(rest.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap().to_string());
            }
        }
        for name in named {
            let to = if modules.contains(&name) { Some(name) } else { reexported.get(&name).cloned() };
            if let Some(to) = to.filter(|t| *t != from) {
                graph.get_mut(&from).unwrap().insert(to);
            }
        }
    }
    graph
}

#[test]
fn accel_modules_import_no_circle() {
    let graph = accel_module_graph();
    if let Some(circle) = find_circle(&graph) {
        panic!("accel's modules import each other in a circle: {}", circle.join(" → "));
    }
    // The layering the document states: the model and its strategies below the step owner, the step owner
    // below the Accelerator.
    assert!(graph["step"].contains("model") && !graph["model"].contains("step"));
    assert!(graph["accelerator"].contains("step") && !graph["step"].contains("accelerator"));
    assert!(!graph["model"].contains("accelerator") && !graph["optim"].contains("accelerator"));
}

/// A circle in `graph` (module → the modules it names), as the path around it; depth-first search for a back edge.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_string());
            return Some(circle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

/// The files of one module directory (`dir/*.rs`, not `mod.rs` or `tests.rs`) → the siblings each names through
/// `super::` outside its tests.
fn sibling_graph(dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let names: BTreeSet<String> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| f.strip_suffix(".rs").map(str::to_string))
        .filter(|f| f != "mod" && f != "tests")
        .collect();
    names
        .iter()
        .map(|from| {
            let text = read(&format!("{dir}/{from}.rs"));
            let code = code_of(text.split("#[cfg(test)]").next().unwrap());
            let to = code
                .match_indices("super::")
                .filter_map(|(i, _)| code[i + 7..].split(|c: char| !c.is_alphanumeric() && c != '_').next())
                .filter(|n| names.contains(*n) && n != from)
                .map(str::to_string)
                .collect();
            (from.clone(), to)
        })
        .collect()
}

#[test]
fn module_directories_and_ddp_cores_launcher_import_no_circle() {
    for dir in ["crates/accel/src/auto_layout", "crates/accel/src/model", "crates/ddp-core/src/launcher"] {
        let graph = sibling_graph(dir);
        assert!(graph.values().any(|to| !to.is_empty()), "{dir}: the check reads no edge");
        if let Some(circle) = find_circle(&graph) {
            panic!("{dir}: modules import each other in a circle: {}", circle.join(" → "));
        }
    }
    // The launcher and the process group share their constants through `env`, not through each other.
    let launcher = code_of(&read("crates/ddp-core/src/launcher.rs"));
    let group = code_of(&read("crates/ddp-core/src/process_group.rs"));
    assert!(!launcher.contains("process_group::") && !group.contains("launcher::"));
    assert!(sibling_graph("crates/accel/src/auto_layout")["choose"].contains("candidate"));
}

#[test]
fn the_circle_check_sees_a_circle() {
    // The checker itself: the graph it builds has the edges the code has (accelerator → step → model), so
    // a reversed edge would close a circle.
    let graph = accel_module_graph();
    assert!(graph["accelerator"].contains("model"));
    assert!(graph["step"].contains("model"));
    assert!(graph["optim"].contains("step"), "AcceleratedOptimizer takes its gradients from the step owner");
    let edge = |a: &str, b: &str| (a.to_string(), BTreeSet::from([b.to_string()]));
    let circle = BTreeMap::from([edge("a", "b"), edge("b", "c"), edge("c", "a")]);
    assert_eq!(find_circle(&circle).unwrap(), ["a", "b", "c", "a"]);
    assert_eq!(find_circle(&BTreeMap::from([edge("a", "b"), edge("b", "c")])), None);
}

#[test]
fn only_binaries_and_the_trainer_arguments_know_clap() {
    let allowed = |f: &str| {
        f.starts_with("crates/accel-cli/")
            || f.starts_with("examples/src/bin/")
            || f.starts_with("benches/")
            || f == "crates/trainer/src/args.rs"
    };
    for dir in ["crates", "examples/src", "benches/src"] {
        for file in rust_files(dir) {
            if allowed(&file) || file.contains("/tests/") {
                continue;
            }
            let code = code_of(&read(&file));
            assert!(
                !code.contains("clap"),
                "{file} uses clap: only the binaries and trainer::args parse command lines"
            );
        }
    }
    for krate in ["accel-nn", "ddp-core", "accel", "trainer"] {
        let deps = dependencies(&format!("crates/{krate}/Cargo.toml"));
        assert!(!deps.contains("anyhow"), "{krate} depends on anyhow: libraries return their own error type");
        assert!(krate == "trainer" || !deps.contains("clap"), "{krate} depends on clap");
    }
}

#[test]
fn every_file_the_architecture_document_names_exists() {
    let doc = read("docs/ARCHITECTURE.md");
    let files: BTreeSet<String> = ["crates", "examples", "benches"]
        .iter()
        .flat_map(|d| rust_files(d))
        .chain(
            std::fs::read_dir(root().join("scripts"))
                .unwrap()
                .flatten()
                .map(|e| format!("scripts/{}", e.file_name().to_string_lossy())),
        )
        .collect();
    let mut checked = 0;
    for token in doc.split('`').skip(1).step_by(2) {
        let name = token.trim_end_matches(['/', ')']);
        if !(name.ends_with(".rs") || name.ends_with(".sh")) || name.contains(' ') || name.contains('{') {
            continue;
        }
        checked += 1;
        assert!(files.iter().any(|f| f.ends_with(name)), "docs/ARCHITECTURE.md names `{name}`, which no file is");
    }
    assert!(checked > 40, "only {checked} file names found in docs/ARCHITECTURE.md: the parser lost them");
}

/// Values every process must hash alike (a parameter's random stream, a fingerprint compared across ranks) go
/// through `ddp_core::fingerprint`: FNV-1a is written once, recognised by its offset basis.
#[test]
fn fnv_1a_is_written_once() {
    let basis = ["cbf2_9ce4_8422_2325", "cbf29ce484222325"];
    let mut holders = Vec::new();
    for dir in ["crates", "examples/src", "benches/src"] {
        for file in rust_files(dir) {
            let code = code_of(&read(&file)).to_lowercase();
            if basis.iter().any(|b| code.contains(b)) && !file.contains("/tests/") {
                holders.push(file);
            }
        }
    }
    assert_eq!(holders, ["crates/ddp-core/src/fingerprint.rs"], "FNV-1a's offset basis outside ddp_core::fingerprint");
}

/// The run banner: ddp-core renders what it knows (config, processes × machines, the mesh, the backend) and what a
/// higher level hands it; the level-2 words are accel's, and accel builds its banner in one place.
#[test]
fn the_run_banner_is_built_once_and_ddp_core_knows_no_level_2_words() {
    let banner = read("crates/ddp-core/src/launcher/banner.rs");
    let code = code_of(banner.split("#[cfg(test)]").next().unwrap());
    for word in ["mixed", "accumulation", "sharding", "pipeline", "schedule", "auto"] {
        assert!(!code.contains(word), "ddp-core's banner.rs says {word:?}: a level-2 word");
    }
    let mut builders = Vec::new();
    for dir in ["crates", "examples/src", "benches/src"] {
        for file in rust_files(dir) {
            if file.contains("/tests/") {
                continue;
            }
            let text = read(&file);
            // A struct literal: `RunBanner {` that is no type (`-> RunBanner {`), impl or definition.
            let code = code_of(text.split("#[cfg(test)]").next().unwrap());
            let literal = code.lines().any(|l| {
                l.contains("RunBanner {") && !l.contains("->") && !l.contains("impl ") && !l.contains("struct ")
            });
            if literal {
                builders.push(file);
            }
        }
    }
    // accel's one builder, and the level-1 example (which has no Accelerator to ask).
    let expected = ["crates/accel/src/banner.rs", "examples/src/bin/ddp_mnist.rs"];
    assert_eq!(builders.iter().map(String::as_str).collect::<BTreeSet<_>>(), expected.into_iter().collect());
}

/// Only accel-cli knows Accelerate's config file: the library's `ParallelismConfig` has no serde form, and no key of
/// the file's `parallelism_config` or `fsdp_config` blocks is written in the library's code.
#[test]
fn only_accel_cli_knows_accelerates_yaml() {
    for file in rust_files("crates/accel/src") {
        let code = code_of(&read(&file));
        for word in
            ["rename = \"parallelism_config_", "\"fsdp_sharding_strategy\"", "\"data_parallel_size\"", "YAML_KEYS"]
        {
            assert!(!code.contains(word), "{file} has {word}: Accelerate's YAML is accel-cli's");
        }
    }
    let parallelism = code_of(&read("crates/accel/src/parallelism.rs"));
    assert!(!parallelism.contains("Deserialize"), "ParallelismConfig is read from YAML by accel-cli only");
    let block = read("crates/accel-cli/src/parallelism_block.rs");
    assert!(block.contains("impl From<ParallelismBlock> for ParallelismConfig"));
}

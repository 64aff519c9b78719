//! The serving binary links no benchmark: `rngd-pd` exports no `proxy_*`
//! symbol (the policy benchmark's native baseline defines the proxy-wasm host
//! functions as `#[no_mangle]` `proxy_*` symbols; they belong in
//! `rngd-pd-bench` only). Read from the symbol tables (static and dynamic) of
//! the built ELF files.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSymbol};

/// Every symbol name (static `.symtab` and dynamic `.dynsym`) of an ELF file.
fn symbol_names(path: &Path) -> Vec<String> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let file = object::File::parse(&*data)
        .unwrap_or_else(|e| panic!("parsing {} as an object file: {e}", path.display()));
    file.symbols()
        .chain(file.dynamic_symbols())
        .filter_map(|s| s.name().ok().map(str::to_string))
        .collect()
}

fn proxy_symbols(path: &Path) -> Vec<String> {
    let mut v: Vec<String> = symbol_names(path)
        .into_iter()
        .filter(|n| n.starts_with("proxy_"))
        .collect();
    v.sort();
    v.dedup();
    v
}

fn serving_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rngd-pd"))
}

#[test]
fn the_serving_binary_exports_no_proxy_symbol() {
    let bin = serving_binary();
    let names = symbol_names(&bin);
    // The reader sees the binary's own symbols (a stripped file would pass
    // vacuously).
    assert!(
        names.iter().any(|n| n == "main"),
        "no `main` among the {} symbols of {}: is it stripped?",
        names.len(),
        bin.display()
    );
    let proxy = proxy_symbols(&bin);
    assert!(
        proxy.is_empty(),
        "{} exports proxy-wasm symbols (a benchmark is linked into it): {proxy:?}",
        bin.display()
    );
}

/// The same reader finds the native baseline's symbols in the benchmark
/// binary, so the test above can fail.
#[test]
fn the_benchmark_binary_does_carry_them() {
    let bench = serving_binary().with_file_name("rngd-pd-bench");
    assert!(
        bench.is_file(),
        "{} is not built: `cargo build --release -p rngd-pd-bench` first \
         (tests/run builds the whole workspace before `cargo test`)",
        bench.display()
    );
    let proxy = proxy_symbols(&bench);
    for expected in ["proxy_on_memory_allocate", "proxy_get_buffer_bytes"] {
        assert!(
            proxy.iter().any(|n| n == expected),
            "{expected} not among the proxy_* symbols of {}: {proxy:?}",
            bench.display()
        );
    }
}

//! Test-only policy guests built in the test itself (wasm-encoder, no build
//! step): proxy-wasm 0.2.1 HTTP filters that pass the self-test (they route
//! every canned request to their `destination`) and misbehave only on
//! request headers the canned requests never carry:
//!
//! | request header | what the guest does |
//! |---|---|
//! | `x-slow` (every request with `slow_always`) | spins `slow_headers_ms` in the headers callback and `slow_body_ms` in the body callback (on the host's clock, `proxy_get_current_time_nanoseconds`) |
//! | `trap_on` (if set) | traps (`unreachable`) in the headers callback |
//! | `x-greedy` | tries to make the host keep ever more: shared data (1 KiB values, new keys), headers (new names, 100-byte values), one 1 MiB log line, then 10,000 small ones; each loop stops at the first refusal, and the report headers below say how far it got |
//!
//! Report headers of `x-greedy` (numbers as 8 letters `a`..`p`, one per
//! hex digit, most significant first; see [`number`]): `x-shared-ok`,
//! `x-shared-status`, `x-headers-ok`, `x-headers-status`, `x-log-big-status`,
//! `x-log-ok`, `x-log-status`.

#![allow(dead_code)]

use wasm_encoder::{
    BlockType, CodeSection, ConstExpr, DataSection, EntityType, ExportKind, ExportSection,
    Function, FunctionSection, GlobalSection, GlobalType, ImportSection, InstructionSink, MemArg,
    MemorySection, MemoryType, Module, TypeSection, ValType,
};

/// What a test guest does (see the module docs).
#[derive(Clone, Debug)]
pub struct Spec {
    /// Where it routes (`x-gateway-destination-endpoint`).
    pub destination: &'static str,
    /// Spin in the headers callback on `x-slow`, ms.
    pub slow_headers_ms: u32,
    /// Spin in the body callback on `x-slow`, ms.
    pub slow_body_ms: u32,
    /// Spin as on `x-slow` on every request (the canned ones too).
    pub slow_always: bool,
    /// Trap in the headers callback when this request header is present.
    pub trap_on: Option<&'static str>,
    /// React to `x-greedy`.
    pub greedy: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            destination: "10.0.0.1:1",
            slow_headers_ms: 0,
            slow_body_ms: 0,
            slow_always: false,
            trap_on: None,
            greedy: false,
        }
    }
}

/// The report names `x-greedy` sets.
pub const REPORTS: [&str; 7] = [
    "x-shared-ok",
    "x-shared-status",
    "x-headers-ok",
    "x-headers-status",
    "x-log-big-status",
    "x-log-ok",
    "x-log-status",
];

/// Decodes a report value (8 letters `a`..`p`, one per hex digit).
pub fn number(text: &str) -> u32 {
    assert_eq!(text.len(), 8, "report value {text:?}");
    text.bytes().fold(0, |n, c| {
        assert!((b'a'..=b'p').contains(&c), "report value {text:?}");
        (n << 4) | u32::from(c - b'a')
    })
}

// Memory layout (one memory of 64 pages).
const TMP: i32 = 0; // 8 bytes: the clock's answer
const RET_PTR: i32 = 8;
const RET_LEN: i32 = 12;
const HEX: i32 = 16; // 8 letters
const KEY: i32 = 32; // "x-f" + 8 letters
const KEY_LEN: i32 = 11;
const STRINGS: i32 = 64;
const VAL: i32 = 4096; // 1 KiB of 'v'
const BIG: i32 = 65536; // 1 MiB (zeros)
const HEAP: i32 = 2 << 20;
const MEMORY_END: i32 = 4 << 20;

// Imports.
const NOW: u32 = 0;
const GET_HEADER: u32 = 1;
const REPLACE_HEADER: u32 = 2;
const ADD_HEADER: u32 = 3;
const SET_SHARED: u32 = 4;
const LOG: u32 = 5;
// Own functions, after the imports.
const MALLOC: u32 = 6;
const SPIN: u32 = 15;
const HAS_HEADER: u32 = 16;
const HEX8: u32 = 17;
const SET: u32 = 18;
const GREEDY: u32 = 19;

// Globals.
const G_BUMP: u32 = 0;
const G_SLOW: u32 = 1;

fn mem(align: u32) -> MemArg {
    MemArg {
        offset: 0,
        align,
        memory_index: 0,
    }
}

/// Strings laid out from `STRINGS`: (address, length) by name.
struct Strings {
    data: Vec<u8>,
    at: Vec<(String, i32, i32)>,
}

impl Strings {
    fn add(&mut self, s: &str) {
        let addr = STRINGS + self.data.len() as i32;
        self.data.extend_from_slice(s.as_bytes());
        self.at.push((s.to_string(), addr, s.len() as i32));
    }

    fn get(&self, s: &str) -> (i32, i32) {
        let (_, a, l) = self
            .at
            .iter()
            .find(|(n, _, _)| n == s)
            .unwrap_or_else(|| panic!("string {s} not laid out"));
        (*a, *l)
    }
}

/// `set(name, value)`: replaces a request header (status dropped).
fn set_str(f: &mut InstructionSink<'_>, name: (i32, i32), value: (i32, i32)) {
    f.i32_const(name.0)
        .i32_const(name.1)
        .i32_const(value.0)
        .i32_const(value.1)
        .call(SET)
        .drop();
}

/// Writes the number on the stack as report letters at `HEX`, then sets
/// header `name` to them.
fn report(f: &mut InstructionSink<'_>, name: (i32, i32)) {
    f.call(HEX8);
    set_str(f, name, (HEX, 8));
}

/// A loop that runs `each` (which leaves a status) with `KEY` holding the
/// count, counting successes in local 0 until a refusal (its status in
/// local 1) or `max`.
fn flood(s: &mut InstructionSink<'_>, each: impl Fn(&mut InstructionSink<'_>), max: i32) {
    s.i32_const(0).local_set(0);
    s.loop_(BlockType::Empty);
    s.local_get(0).call(HEX8);
    s.i32_const(KEY + 3)
        .i32_const(HEX)
        .i64_load(mem(0))
        .i64_store(mem(0));
    each(s);
    s.local_tee(1)
        .i32_eqz()
        .if_(BlockType::Empty)
        .local_get(0)
        .i32_const(1)
        .i32_add()
        .local_tee(0)
        .i32_const(max)
        .i32_lt_u()
        .br_if(1)
        .end()
        .end();
}

/// The module for `spec`.
pub fn module(spec: &Spec) -> Vec<u8> {
    let mut strings = Strings {
        data: Vec::new(),
        at: Vec::new(),
    };
    for s in [
        "x-gateway-destination-endpoint",
        spec.destination,
        "x-slow",
        "x-greedy",
        "aaaaaaaa",
    ]
    .into_iter()
    .chain(REPORTS)
    .chain(spec.trap_on)
    {
        strings.add(s);
    }
    assert!(STRINGS as usize + strings.data.len() < VAL as usize);

    let mut types = TypeSection::new();
    let i = ValType::I32;
    let sigs: [(&[ValType], &[ValType]); 9] = [
        (&[i], &[i]),             // 0
        (&[i, i, i, i, i], &[i]), // 1
        (&[i, i, i], &[i]),       // 2
        (&[], &[]),               // 3
        (&[i, i], &[i]),          // 4
        (&[i, i], &[]),           // 5
        (&[i], &[]),              // 6
        (&[ValType::I64], &[]),   // 7
        (&[i, i, i, i], &[i]),    // 8
    ];
    for (p, r) in sigs {
        types.ty().function(p.iter().copied(), r.iter().copied());
    }

    let mut imports = ImportSection::new();
    for (name, ty) in [
        ("proxy_get_current_time_nanoseconds", 0),
        ("proxy_get_header_map_value", 1),
        ("proxy_replace_header_map_value", 1),
        ("proxy_add_header_map_value", 1),
        ("proxy_set_shared_data", 1),
        ("proxy_log", 2),
    ] {
        imports.import("env", name, EntityType::Function(ty));
    }

    // (export name or "", type, body)
    let mut funcs: Vec<(&str, u32, Function)> = Vec::new();

    // 6 malloc(size) -> ptr: a bump allocator that wraps (the host's
    // buffers are read at once).
    let mut f = Function::new([(1, ValType::I32)]);
    f.instructions()
        .global_get(G_BUMP)
        .local_set(1)
        .local_get(1)
        .local_get(0)
        .i32_add()
        .i32_const(MEMORY_END)
        .i32_gt_u()
        .if_(BlockType::Empty)
        .i32_const(HEAP)
        .local_set(1)
        .end()
        .local_get(1)
        .local_get(0)
        .i32_add()
        .global_set(G_BUMP)
        .local_get(1)
        .end();
    funcs.push(("malloc", 0, f));

    // 7 proxy_abi_version_0_2_1
    let mut f = Function::new([]);
    f.instructions().end();
    funcs.push(("proxy_abi_version_0_2_1", 3, f));
    // 8 proxy_on_vm_start, 9 proxy_on_configure: true
    for name in ["proxy_on_vm_start", "proxy_on_configure"] {
        let mut f = Function::new([]);
        f.instructions().i32_const(1).end();
        funcs.push((name, 4, f));
    }
    // 10 proxy_on_context_create
    let mut f = Function::new([]);
    f.instructions().end();
    funcs.push(("proxy_on_context_create", 5, f));

    // 11 proxy_on_request_headers(ctx, n, eos) -> action
    let mut f = Function::new([]);
    {
        let mut s = f.instructions();
        set_str(
            &mut s,
            strings.get("x-gateway-destination-endpoint"),
            strings.get(spec.destination),
        );
        if let Some(h) = spec.trap_on {
            let (a, l) = strings.get(h);
            s.i32_const(a)
                .i32_const(l)
                .call(HAS_HEADER)
                .if_(BlockType::Empty)
                .unreachable()
                .end();
        }
        let (a, l) = strings.get("x-slow");
        s.i32_const(0).global_set(G_SLOW);
        if spec.slow_always {
            s.i32_const(1);
        } else {
            s.i32_const(a).i32_const(l).call(HAS_HEADER);
        }
        s.if_(BlockType::Empty)
            .i32_const(1)
            .global_set(G_SLOW)
            .i64_const(i64::from(spec.slow_headers_ms) * 1_000_000)
            .call(SPIN)
            .end();
        if spec.greedy {
            let (a, l) = strings.get("x-greedy");
            s.i32_const(a)
                .i32_const(l)
                .call(HAS_HEADER)
                .if_(BlockType::Empty)
                .call(GREEDY)
                .end();
        }
        s.i32_const(0).end();
    }
    funcs.push(("proxy_on_request_headers", 2, f));

    // 12 proxy_on_request_body(ctx, len, eos) -> action
    let mut f = Function::new([]);
    f.instructions()
        .global_get(G_SLOW)
        .if_(BlockType::Empty)
        .i64_const(i64::from(spec.slow_body_ms) * 1_000_000)
        .call(SPIN)
        .end()
        .i32_const(0)
        .end();
    funcs.push(("proxy_on_request_body", 2, f));
    // 13 proxy_on_done(ctx) -> bool
    let mut f = Function::new([]);
    f.instructions().i32_const(1).end();
    funcs.push(("proxy_on_done", 0, f));
    // 14 proxy_on_delete(ctx)
    let mut f = Function::new([]);
    f.instructions().end();
    funcs.push(("proxy_on_delete", 6, f));

    // 15 spin(ns: i64): until the host clock says `ns` have passed.
    let mut f = Function::new([(1, ValType::I64)]);
    f.instructions()
        .i32_const(TMP)
        .call(NOW)
        .drop()
        .i32_const(TMP)
        .i64_load(mem(3))
        .local_set(1)
        .loop_(BlockType::Empty)
        .i32_const(TMP)
        .call(NOW)
        .drop()
        .i32_const(TMP)
        .i64_load(mem(3))
        .local_get(1)
        .i64_sub()
        .local_get(0)
        .i64_lt_s()
        .br_if(0)
        .end()
        .end();
    funcs.push(("", 7, f));

    // 16 has_header(ptr, len) -> 1 if the request has it
    let mut f = Function::new([]);
    f.instructions()
        .i32_const(0)
        .local_get(0)
        .local_get(1)
        .i32_const(RET_PTR)
        .i32_const(RET_LEN)
        .call(GET_HEADER)
        .i32_eqz()
        .end();
    funcs.push(("", 4, f));

    // 17 hex8(v): 8 letters 'a' + nibble at HEX, most significant first
    let mut f = Function::new([(1, ValType::I32)]);
    f.instructions()
        .i32_const(0)
        .local_set(1)
        .loop_(BlockType::Empty)
        // HEX + i
        .i32_const(HEX)
        .local_get(1)
        .i32_add()
        // 'a' + ((v >> (28 - 4i)) & 15)
        .local_get(0)
        .i32_const(28)
        .local_get(1)
        .i32_const(2)
        .i32_shl()
        .i32_sub()
        .i32_shr_u()
        .i32_const(15)
        .i32_and()
        .i32_const(i32::from(b'a'))
        .i32_add()
        .i32_store8(mem(0))
        .local_get(1)
        .i32_const(1)
        .i32_add()
        .local_tee(1)
        .i32_const(8)
        .i32_lt_u()
        .br_if(0)
        .end()
        .end();
    funcs.push(("", 6, f));

    // 18 set(kp, kl, vp, vl) -> status (replace a request header)
    let mut f = Function::new([]);
    f.instructions()
        .i32_const(0)
        .local_get(0)
        .local_get(1)
        .local_get(2)
        .local_get(3)
        .call(REPLACE_HEADER)
        .end();
    funcs.push(("", 8, f));

    // 19 greedy()
    // locals: 0 count, 1 status
    let mut f = Function::new([(2, ValType::I32)]);
    {
        let mut s = f.instructions();
        for r in REPORTS {
            set_str(&mut s, strings.get(r), strings.get("aaaaaaaa"));
        }
        flood(
            &mut s,
            |s| {
                s.i32_const(KEY)
                    .i32_const(KEY_LEN)
                    .i32_const(VAL)
                    .i32_const(1024)
                    .i32_const(0)
                    .call(SET_SHARED);
            },
            100_000,
        );
        s.local_get(0);
        report(&mut s, strings.get("x-shared-ok"));
        s.local_get(1);
        report(&mut s, strings.get("x-shared-status"));
        flood(
            &mut s,
            |s| {
                s.i32_const(0)
                    .i32_const(KEY)
                    .i32_const(KEY_LEN)
                    .i32_const(VAL)
                    .i32_const(100)
                    .call(ADD_HEADER);
            },
            100_000,
        );
        s.local_get(0);
        report(&mut s, strings.get("x-headers-ok"));
        s.local_get(1);
        report(&mut s, strings.get("x-headers-status"));
        s.i32_const(2).i32_const(BIG).i32_const(1 << 20).call(LOG);
        report(&mut s, strings.get("x-log-big-status"));
        flood(
            &mut s,
            |s| {
                s.i32_const(2).i32_const(VAL).i32_const(16).call(LOG);
            },
            10_000,
        );
        s.local_get(0);
        report(&mut s, strings.get("x-log-ok"));
        s.local_get(1);
        report(&mut s, strings.get("x-log-status"));
        s.end();
    }
    funcs.push(("", 3, f));

    assert_eq!(funcs.len() as u32 + 6, GREEDY + 1);
    let mut functions = FunctionSection::new();
    let mut exports = ExportSection::new();
    let mut code = CodeSection::new();
    for (n, (name, ty, body)) in funcs.iter().enumerate() {
        functions.function(*ty);
        if !name.is_empty() {
            exports.export(name, ExportKind::Func, 6 + n as u32);
        }
        code.function(body);
    }
    exports.export("memory", ExportKind::Memory, 0);

    let mut memories = MemorySection::new();
    memories.memory(MemoryType {
        minimum: (MEMORY_END as u64) >> 16,
        maximum: None,
        memory64: false,
        shared: false,
        page_size_log2: None,
    });
    let mut globals = GlobalSection::new();
    for init in [HEAP, 0] {
        globals.global(
            GlobalType {
                val_type: ValType::I32,
                mutable: true,
                shared: false,
            },
            &ConstExpr::i32_const(init),
        );
    }
    let mut data = DataSection::new();
    data.active(
        0,
        &ConstExpr::i32_const(KEY),
        b"x-faaaaaaaa".iter().copied(),
    );
    data.active(
        0,
        &ConstExpr::i32_const(STRINGS),
        strings.data.iter().copied(),
    );
    data.active(0, &ConstExpr::i32_const(VAL), vec![b'v'; 1024]);

    let mut module = Module::new();
    module
        .section(&types)
        .section(&imports)
        .section(&functions)
        .section(&memories)
        .section(&globals)
        .section(&exports)
        .section(&code)
        .section(&data);
    module.finish()
}

//! What a `shm` root holds, read from outside the workers: request files
//! (pushed files and pointer files, `*.kv`, and temporary files) and the
//! prefill workers' slot arenas (`*.kva`), whose header entries say which
//! slots are not free (the layout in `docs/kv-wire.md`, "Slot arena").

use std::os::unix::fs::FileExt;
use std::path::Path;

/// Request files in `root` (not the arenas): 0 when nothing is held.
pub fn request_files(root: &Path) -> usize {
    entries(root)
        .iter()
        .filter(|n| !n.ends_with(".kva"))
        .count()
}

/// Arena files in `root`.
pub fn arenas(root: &Path) -> usize {
    entries(root).iter().filter(|n| n.ends_with(".kva")).count()
}

/// Slots not free in every arena of `root`: 0 when no slot is held.
pub fn busy_slots(root: &Path) -> usize {
    let mut busy = 0;
    for name in entries(root).iter().filter(|n| n.ends_with(".kva")) {
        // The file may go (its owner exited) while it is read.
        let Ok(f) = std::fs::File::open(root.join(name)) else {
            continue;
        };
        let mut head = [0u8; 12];
        if f.read_exact_at(&mut head, 0).is_err() || &head[..8] != b"RNGDKVA1" {
            continue;
        }
        let slots = u32::from_le_bytes(head[8..12].try_into().unwrap()) as u64;
        for i in 0..slots {
            let mut state = [0u8; 4];
            if f.read_exact_at(&mut state, 64 + 64 * i).is_ok() && state != [0; 4] {
                busy += 1;
            }
        }
    }
    busy
}

fn entries(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

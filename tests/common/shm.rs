//! What a `shm` root holds, read from outside the workers: request files
//! (pushed files and pointer files, `*.kv`, and temporary files) and the
//! prefill workers' slot arenas (`*.kva`), whose headers say which slots
//! are not free (`rngd_kv_transport::shm::busy_slots_in`).

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
    entries(root)
        .iter()
        .filter(|n| n.ends_with(".kva"))
        // The file may go (its owner exited) while it is read.
        .filter_map(|n| rngd_kv_transport::shm::busy_slots_in(&root.join(n)))
        .sum()
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

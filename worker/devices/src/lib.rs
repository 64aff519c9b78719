//! Device allocation: which NPU card this pod owns, from the kubelet device-plugin checkpoint.
//!
//! - [`checkpoint`]: parses the kubelet checkpoint (`kubelet_internal_checkpoint`),
//!   accepting both the list and the NUMA-map shapes of `DeviceIDs`.
//! - [`cards`]: lists the cards visible in this container ([`CardLister`], with
//!   a real directory scanner and a fake for tests).
//! - [`select_chip`]: turns `--chip N|-1` into a card ordinal.
//!
//! See `docs/devices.md`.

pub mod cards;
pub mod checkpoint;

use std::path::{Path, PathBuf};

pub use cards::{Card, CardLister, DirCardLister, FakeCards};
pub use checkpoint::{Checkpoint, PodDeviceEntry};

/// Default path of the kubelet device-plugin checkpoint.
pub const DEFAULT_CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";

/// Errors of device allocation.
#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    /// The checkpoint exists but cannot be read.
    #[error("cannot read kubelet checkpoint {path}: {source}")]
    ReadCheckpoint {
        /// Checkpoint path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint is not the JSON kubelet writes.
    #[error("malformed kubelet checkpoint {path}: {source}")]
    MalformedCheckpoint {
        /// Checkpoint path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// A device directory cannot be listed.
    #[error("cannot list devices in {dir}: {source}")]
    ListDevices {
        /// Directory.
        dir: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No card is visible at all.
    #[error("no NPU card is visible (looked for {looked_for})")]
    NoCards {
        /// What was scanned.
        looked_for: String,
    },
    /// Several cards are visible and the checkpoint has no record for this pod.
    #[error(
        "{count} NPU cards are visible ({cards}) and the kubelet checkpoint {checkpoint} has no allocation for pod {pod}; \
         refusing to guess: pass --chip N or run under the device plugin"
    )]
    Ambiguous {
        /// Number of visible cards.
        count: usize,
        /// Their names.
        cards: String,
        /// Checkpoint path.
        checkpoint: PathBuf,
        /// Pod UID, or `(POD_UID unset)`.
        pod: String,
    },
    /// The allocated device id matches no visible card.
    #[error("device {device} allocated to pod {pod} is not among the visible cards ({cards})")]
    AllocatedNotVisible {
        /// Device id from the checkpoint.
        device: String,
        /// Pod UID.
        pod: String,
        /// Visible card names.
        cards: String,
    },
    /// `--chip` below -1.
    #[error("invalid chip {0}: use an ordinal >= 0, or -1 for the device plugin's allocation")]
    InvalidChip(i64),
}

/// How the chip was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `--chip N` given explicitly.
    Explicit,
    /// From the device plugin's allocation for this pod.
    Allocated {
        /// The device id in the checkpoint (e.g. `npu3`).
        device_id: String,
        /// The resource name (e.g. `furiosa.ai/rngd`).
        resource: String,
    },
    /// No allocation record, exactly one card visible: that card.
    OnlyCard,
}

/// The chosen card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Ordinal among the visible cards (what the runtimes call the device index).
    pub ordinal: usize,
    /// Card name, if a card was looked up (`None` for an explicit `--chip N`).
    pub card: Option<String>,
    /// How it was chosen.
    pub source: Source,
}

/// Inputs of [`select_chip`] besides the card list.
#[derive(Debug, Clone)]
pub struct AllocationQuery<'a> {
    /// `--chip`: an ordinal, or -1 for the device plugin's allocation.
    pub chip: i64,
    /// This pod's UID (`POD_UID`).
    pub pod_uid: Option<&'a str>,
    /// Checkpoint path (a missing file means "no record").
    pub checkpoint: &'a Path,
    /// Resource-name prefixes that name NPU cards (e.g. `furiosa.ai/`); empty = any resource.
    pub resource_prefixes: &'a [&'a str],
}

/// Resolves `--chip` to a card ordinal.
///
/// - `chip >= 0`: that ordinal, unchecked (the backend validates it).
/// - `chip == -1`: the card the device plugin allocated to `pod_uid` per the
///   checkpoint, mapped to its ordinal among the visible cards; with no record,
///   the only visible card, or [`DevicesError::Ambiguous`] when several are visible.
///   With several allocated cards the lowest ordinal is used.
pub fn select_chip(
    query: &AllocationQuery<'_>,
    lister: &dyn CardLister,
) -> Result<Selection, DevicesError> {
    if query.chip >= 0 {
        return Ok(Selection {
            ordinal: query.chip as usize,
            card: None,
            source: Source::Explicit,
        });
    }
    if query.chip != -1 {
        return Err(DevicesError::InvalidChip(query.chip));
    }
    let cards = lister.list()?;
    if cards.is_empty() {
        return Err(DevicesError::NoCards {
            looked_for: lister.describe(),
        });
    }
    let names = || {
        cards
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let checkpoint = Checkpoint::load_if_exists(query.checkpoint)?;
    let allocated: Vec<(String, String)> = match (query.pod_uid, &checkpoint) {
        (Some(pod), Some(cp)) => cp
            .devices_for_pod(pod)
            .filter(|(entry, _)| {
                query.resource_prefixes.is_empty()
                    || query
                        .resource_prefixes
                        .iter()
                        .any(|p| entry.resource_name.starts_with(p))
            })
            .map(|(entry, id)| (id.to_string(), entry.resource_name.clone()))
            .collect(),
        _ => Vec::new(),
    };
    if allocated.is_empty() {
        if cards.len() == 1 {
            return Ok(Selection {
                ordinal: 0,
                card: Some(cards[0].name.clone()),
                source: Source::OnlyCard,
            });
        }
        return Err(DevicesError::Ambiguous {
            count: cards.len(),
            cards: names(),
            checkpoint: query.checkpoint.to_path_buf(),
            pod: query.pod_uid.unwrap_or("(POD_UID unset)").to_string(),
        });
    }
    let mut best: Option<(usize, &(String, String))> = None;
    for alloc in &allocated {
        let ordinal = cards::ordinal_of(&cards, &alloc.0).ok_or_else(|| {
            DevicesError::AllocatedNotVisible {
                device: alloc.0.clone(),
                pod: query.pod_uid.unwrap_or_default().to_string(),
                cards: names(),
            }
        })?;
        if best.is_none_or(|(b, _)| ordinal < b) {
            best = Some((ordinal, alloc));
        }
    }
    let (ordinal, (device_id, resource)) = best.expect("allocated is not empty");
    Ok(Selection {
        ordinal,
        card: Some(cards[ordinal].name.clone()),
        source: Source::Allocated {
            device_id: device_id.clone(),
            resource: resource.clone(),
        },
    })
}

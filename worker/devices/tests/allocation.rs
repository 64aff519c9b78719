//! Device allocation against fixture checkpoints and fake card lists.

use std::path::{Path, PathBuf};

use rngd_devices::{AllocationQuery, DevicesError, FakeCards, Selection, Source, select_chip};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

const RNGD: &[&str] = &["furiosa.ai/"];

fn select(
    chip: i64,
    pod: Option<&str>,
    checkpoint: &Path,
    cards: &[&str],
) -> Result<Selection, DevicesError> {
    let q = AllocationQuery {
        chip,
        pod_uid: pod,
        checkpoint,
        resource_prefixes: RNGD,
    };
    select_chip(&q, &FakeCards::named("npu", cards))
}

#[test]
fn allocated_card_is_found() {
    let s = select(
        -1,
        Some("0f6c7a1e-aaaa-4bbb-8ccc-000000000001"),
        &fixture("allocated.json"),
        &["npu0", "npu1"],
    )
    .unwrap();
    assert_eq!(s.ordinal, 1);
    assert_eq!(s.card.as_deref(), Some("npu1"));
    assert_eq!(
        s.source,
        Source::Allocated {
            device_id: "npu1".into(),
            resource: "furiosa.ai/rngd".into()
        }
    );
    // The other pod in the same checkpoint gets its own card.
    let other = select(
        -1,
        Some("0f6c7a1e-aaaa-4bbb-8ccc-000000000002"),
        &fixture("allocated.json"),
        &["npu0", "npu1"],
    )
    .unwrap();
    assert_eq!(other.ordinal, 0);
}

#[test]
fn ordinal_mapping_skips_absent_cards() {
    // npu2 is absent, so npu3 is the third visible card: ordinal 2.
    let s = select(
        -1,
        Some("pod-gaps"),
        &fixture("gaps_legacy_list.json"),
        &["npu0", "npu1", "npu3"],
    )
    .unwrap();
    assert_eq!(s.ordinal, 2);
    assert_eq!(s.card.as_deref(), Some("npu3"));
}

#[test]
fn no_record_with_one_card_uses_it() {
    let s = select(-1, Some("my-pod"), &fixture("no_record.json"), &["npu5"]).unwrap();
    assert_eq!(s.ordinal, 0);
    assert_eq!(s.card.as_deref(), Some("npu5"));
    assert_eq!(s.source, Source::OnlyCard);
    // A missing checkpoint file is "no record" too.
    let s = select(-1, None, &fixture("does-not-exist.json"), &["npu5"]).unwrap();
    assert_eq!(s.source, Source::OnlyCard);
}

#[test]
fn no_record_with_several_cards_refuses() {
    let err = select(
        -1,
        Some("my-pod"),
        &fixture("no_record.json"),
        &["npu0", "npu1"],
    )
    .unwrap_err();
    assert!(
        matches!(err, DevicesError::Ambiguous { count: 2, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("my-pod") && msg.contains("npu0, npu1") && msg.contains("refusing to guess"),
        "{msg}"
    );
}

#[test]
fn malformed_checkpoint_is_an_error_naming_the_file() {
    let err = select(
        -1,
        Some("pod-gaps"),
        &fixture("malformed.json"),
        &["npu0", "npu1"],
    )
    .unwrap_err();
    assert!(
        matches!(err, DevicesError::MalformedCheckpoint { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("malformed.json"));
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn allocated_card_not_visible_is_an_error() {
    let err = select(
        -1,
        Some("pod-gaps"),
        &fixture("gaps_legacy_list.json"),
        &["npu0", "npu1"],
    )
    .unwrap_err();
    assert!(
        matches!(err, DevicesError::AllocatedNotVisible { .. }),
        "{err:?}"
    );
}

#[test]
fn explicit_chip_and_no_cards() {
    let s = select(3, None, &fixture("malformed.json"), &[]).unwrap();
    assert_eq!((s.ordinal, s.source), (3, Source::Explicit));
    assert!(matches!(
        select(-1, None, &fixture("no_record.json"), &[]),
        Err(DevicesError::NoCards { .. })
    ));
    assert!(matches!(
        select(-2, None, &fixture("no_record.json"), &[]),
        Err(DevicesError::InvalidChip(-2))
    ));
}

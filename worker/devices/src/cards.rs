//! The cards visible in this container.
//!
//! [`DirCardLister`] scans device directories for names with a prefix and a
//! number (`/dev/rngd/npu0`, `/dev/rbln3`); [`FakeCards`] is a fixed list for
//! tests. Cards are ordered by their number; a card's ordinal is its index in
//! that order, so `npu3` is ordinal 2 when `npu2` is absent.

use std::path::PathBuf;

use crate::DevicesError;

/// One visible card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Card {
    /// Name as in the device directory (`npu3`, `rbln0`).
    pub name: String,
    /// The number in the name.
    pub index: u32,
}

impl Card {
    /// A card from a name ending in digits after `prefix`; `None` otherwise.
    pub fn parse(name: &str, prefix: &str) -> Option<Card> {
        let digits = name.strip_prefix(prefix)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Card {
            name: name.to_string(),
            index: digits.parse().ok()?,
        })
    }
}

/// Lists the visible cards (environment edge: the device directory).
pub trait CardLister: Send + Sync {
    /// The visible cards, sorted by number.
    fn list(&self) -> Result<Vec<Card>, DevicesError>;
    /// What is scanned, for error messages.
    fn describe(&self) -> String;
}

/// Scans `(directory, prefix)` pairs, e.g. `("/dev/rngd", "npu")`.
#[derive(Debug, Clone)]
pub struct DirCardLister {
    /// Directories and name prefixes.
    pub patterns: Vec<(PathBuf, String)>,
}

impl DirCardLister {
    /// FuriosaAI RNGD cards: `/dev/rngd/npu*`.
    pub fn rngd() -> Self {
        DirCardLister {
            patterns: vec![(PathBuf::from("/dev/rngd"), "npu".into())],
        }
    }

    /// Rebellions ATOM cards: `/dev/rbln*`.
    pub fn atom() -> Self {
        DirCardLister {
            patterns: vec![(PathBuf::from("/dev"), "rbln".into())],
        }
    }
}

impl CardLister for DirCardLister {
    fn list(&self) -> Result<Vec<Card>, DevicesError> {
        let mut cards = Vec::new();
        for (dir, prefix) in &self.patterns {
            let entries = match std::fs::read_dir(dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(DevicesError::ListDevices {
                        dir: dir.clone(),
                        source,
                    });
                }
            };
            for entry in entries {
                let entry = entry.map_err(|source| DevicesError::ListDevices {
                    dir: dir.clone(),
                    source,
                })?;
                if let Some(card) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| Card::parse(n, prefix))
                {
                    cards.push(card);
                }
            }
        }
        cards.sort_by_key(|c| c.index);
        Ok(cards)
    }

    fn describe(&self) -> String {
        self.patterns
            .iter()
            .map(|(d, p)| format!("{}/{p}*", d.display()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A fixed card list (tests).
#[derive(Debug, Clone, Default)]
pub struct FakeCards(pub Vec<Card>);

impl FakeCards {
    /// Cards from names with `prefix` (names that do not parse are skipped).
    pub fn named(prefix: &str, names: &[&str]) -> Self {
        let mut cards: Vec<Card> = names
            .iter()
            .filter_map(|n| Card::parse(n, prefix))
            .collect();
        cards.sort_by_key(|c| c.index);
        FakeCards(cards)
    }
}

impl CardLister for FakeCards {
    fn list(&self) -> Result<Vec<Card>, DevicesError> {
        Ok(self.0.clone())
    }

    fn describe(&self) -> String {
        "fake cards".into()
    }
}

/// Ordinal of the card a device id names: matched by name (a path's last
/// component, so `/dev/rngd/npu3` works), else by the trailing number.
pub fn ordinal_of(cards: &[Card], device_id: &str) -> Option<usize> {
    let base = device_id.rsplit('/').next().unwrap_or(device_id);
    if let Some(i) = cards.iter().position(|c| c.name == base) {
        return Some(i);
    }
    let digits: String = base
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect();
    if digits.is_empty() {
        return None;
    }
    let n: u32 = digits.chars().rev().collect::<String>().parse().ok()?;
    cards.iter().position(|c| c.index == n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_skip_gaps() {
        let cards = FakeCards::named("npu", &["npu3", "npu0", "npu1", "npux"]).0;
        assert_eq!(
            cards.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["npu0", "npu1", "npu3"]
        );
        assert_eq!(ordinal_of(&cards, "npu3"), Some(2));
        assert_eq!(ordinal_of(&cards, "/dev/rngd/npu1"), Some(1));
        assert_eq!(ordinal_of(&cards, "npu2"), None);
    }

    #[test]
    fn dir_lister_reads_a_directory() {
        let dir = std::env::temp_dir().join(format!("rngd-devices-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in ["npu2", "npu0", "npu0pe0", "other"] {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        let lister = DirCardLister {
            patterns: vec![(dir.clone(), "npu".into())],
        };
        let names: Vec<String> = lister.list().unwrap().into_iter().map(|c| c.name).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["npu0", "npu2"]);
    }
}

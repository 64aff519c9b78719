//! The kubelet device-plugin checkpoint (`kubelet_internal_checkpoint`).
//!
//! Shape (kubelet writes Go field names):
//! `{"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName",
//! "DeviceIDs", "AllocResp"}], "RegisteredDevices": {...}}, "Checksum": N}`.
//! `DeviceIDs` is a map NUMA node → ids in kubelets since 1.20 and a plain list
//! before; both are accepted. The checksum is kept but not verified (kubelet
//! computes it over Go's in-memory representation, which JSON does not carry).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::DevicesError;

/// A parsed checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct Checkpoint {
    /// The data part.
    #[serde(rename = "Data")]
    pub data: CheckpointData,
    /// Kubelet's checksum (not verified).
    #[serde(rename = "Checksum", default)]
    pub checksum: u64,
}

/// The `Data` part of a checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct CheckpointData {
    /// One entry per (pod, container, resource).
    #[serde(
        rename = "PodDeviceEntries",
        default,
        deserialize_with = "null_as_empty"
    )]
    pub pod_device_entries: Vec<PodDeviceEntry>,
}

/// One allocation record.
#[derive(Debug, Clone, Deserialize)]
pub struct PodDeviceEntry {
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// Container name.
    #[serde(rename = "ContainerName", default)]
    pub container_name: String,
    /// Extended resource name (e.g. `furiosa.ai/rngd`).
    #[serde(rename = "ResourceName")]
    pub resource_name: String,
    /// Allocated device ids.
    #[serde(rename = "DeviceIDs")]
    pub device_ids: DeviceIds,
}

/// `DeviceIDs` in either shape.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum DeviceIds {
    /// Kubelet >= 1.20: NUMA node → ids.
    ByNuma(BTreeMap<String, Vec<String>>),
    /// Older kubelets: a list.
    List(Vec<String>),
}

impl DeviceIds {
    /// All ids, NUMA nodes in key order.
    pub fn ids(&self) -> Vec<&str> {
        match self {
            DeviceIds::ByNuma(m) => m.values().flatten().map(String::as_str).collect(),
            DeviceIds::List(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<PodDeviceEntry>, D::Error> {
    Ok(Option::<Vec<PodDeviceEntry>>::deserialize(d)?.unwrap_or_default())
}

impl Checkpoint {
    /// Parses checkpoint JSON; `path` is only used in the error.
    pub fn parse(json: &[u8], path: &Path) -> Result<Self, DevicesError> {
        serde_json::from_slice(json).map_err(|source| DevicesError::MalformedCheckpoint {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Loads `path`; `Ok(None)` when the file does not exist.
    pub fn load_if_exists(path: &Path) -> Result<Option<Self>, DevicesError> {
        match std::fs::read(path) {
            Ok(bytes) => Self::parse(&bytes, path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(DevicesError::ReadCheckpoint {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Every (entry, device id) allocated to `pod_uid`.
    pub fn devices_for_pod<'a>(
        &'a self,
        pod_uid: &'a str,
    ) -> impl Iterator<Item = (&'a PodDeviceEntry, &'a str)> + 'a {
        self.data
            .pod_device_entries
            .iter()
            .filter(move |e| e.pod_uid == pod_uid)
            .flat_map(|e| e.device_ids.ids().into_iter().map(move |id| (e, id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_device_id_shapes_parse() {
        let new = br#"{"Data":{"PodDeviceEntries":[{"PodUID":"p","ContainerName":"c","ResourceName":"r","DeviceIDs":{"0":["a"],"1":["b"]},"AllocResp":"AA=="}],"RegisteredDevices":{}},"Checksum":1}"#;
        let old = br#"{"Data":{"PodDeviceEntries":[{"PodUID":"p","ContainerName":"c","ResourceName":"r","DeviceIDs":["a","b"]}]},"Checksum":2}"#;
        for json in [&new[..], &old[..]] {
            let cp = Checkpoint::parse(json, Path::new("x")).unwrap();
            let ids: Vec<&str> = cp.devices_for_pod("p").map(|(_, id)| id).collect();
            assert_eq!(ids, ["a", "b"]);
            assert_eq!(cp.devices_for_pod("other").count(), 0);
        }
    }

    #[test]
    fn null_entries_mean_none() {
        let cp = Checkpoint::parse(
            br#"{"Data":{"PodDeviceEntries":null},"Checksum":0}"#,
            Path::new("x"),
        )
        .unwrap();
        assert!(cp.data.pod_device_entries.is_empty());
    }
}

//! Device allocation: which NPU card this pod owns, from the kubelet device-plugin checkpoint

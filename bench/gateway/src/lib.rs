//! `rngd-pd bench gateway`: latency the gateway adds over calling a worker directly

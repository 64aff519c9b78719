//! Every metric name rngd-pd exports. Nothing else in the project spells them.

// Model-server protocol (what GIE / llm-d endpoint pickers scrape from workers).
/// Requests waiting for a decode slot.
pub const VLLM_NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// Requests running.
pub const VLLM_NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// KV cache usage, 0..1.
pub const VLLM_KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
/// Time to first token, seconds (histogram, label `model_name`).
pub const VLLM_TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
/// Arrival to last token, seconds (histogram, label `model_name`).
pub const VLLM_E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
/// Prompt tokens of finished requests (counter, label `model_name`).
pub const VLLM_PROMPT_TOKENS_TOTAL: &str = "vllm:prompt_tokens_total";
/// Generated tokens of finished requests (counter, label `model_name`).
pub const VLLM_GENERATION_TOKENS_TOTAL: &str = "vllm:generation_tokens_total";
/// Finished requests (counter, labels `model_name`, `finished_reason`: `stop`, `length`).
pub const VLLM_REQUEST_SUCCESS_TOTAL: &str = "vllm:request_success_total";
/// vLLM: histogram of the gap between two tokens of one stream, seconds.
pub const VLLM_INTER_TOKEN_LATENCY_SECONDS: &str = "vllm:inter_token_latency_seconds";
/// vLLM's older name of the same gaps (still read by dashboards and
/// `inference-perf`), seconds.
pub const VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "vllm:time_per_output_token_seconds";
/// vLLM: histogram of a request's mean time per output token after the
/// first, seconds.
pub const VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS: &str =
    "vllm:request_time_per_output_token_seconds";
/// vLLM: histogram of the time a request waited before its first engine
/// phase, seconds.
pub const VLLM_REQUEST_QUEUE_TIME_SECONDS: &str = "vllm:request_queue_time_seconds";
/// vLLM: histogram of a request's prefill phase, seconds.
pub const VLLM_REQUEST_PREFILL_TIME_SECONDS: &str = "vllm:request_prefill_time_seconds";
/// vLLM: histogram of a request's decode phase, seconds.
pub const VLLM_REQUEST_DECODE_TIME_SECONDS: &str = "vllm:request_decode_time_seconds";
/// vLLM: histogram of a request's prefill plus decode phases, seconds.
pub const VLLM_REQUEST_INFERENCE_TIME_SECONDS: &str = "vllm:request_inference_time_seconds";
/// vLLM: histogram of prompt tokens per request.
pub const VLLM_REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
/// vLLM: histogram of generated tokens per request.
pub const VLLM_REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
/// vLLM: histogram of each request's `max_tokens`.
pub const VLLM_REQUEST_PARAMS_MAX_TOKENS: &str = "vllm:request_params_max_tokens";
/// vLLM: histogram of each request's `n`.
pub const VLLM_REQUEST_PARAMS_N: &str = "vllm:request_params_n";
/// vLLM: histogram of the most tokens a request may generate (over its
/// `n` sequences).
pub const VLLM_REQUEST_MAX_NUM_GENERATION_TOKENS: &str = "vllm:request_max_num_generation_tokens";
/// vLLM: histogram of the prompt tokens whose KV a request's prefill
/// computed (not read from a cache or loaded from a prefill worker).
pub const VLLM_REQUEST_PREFILL_KV_COMPUTED_TOKENS: &str = "vllm:request_prefill_kv_computed_tokens";
/// vLLM: prompt tokens whose KV was not computed here: found in the prefix
/// cache, or loaded from a prefill worker (counter).
pub const VLLM_PROMPT_TOKENS_CACHED_TOTAL: &str = "vllm:prompt_tokens_cached_total";
/// vLLM: prompt tokens looked up in the KV connector (counter); here, the
/// prompts of requests whose KV a decode worker loaded over a transport.
pub const VLLM_EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL: &str =
    "vllm:external_prefix_cache_queries_total";
/// vLLM: prompt tokens the KV connector supplied (counter); here, the
/// tokens whose KV a decode worker loaded over a transport.
pub const VLLM_EXTERNAL_PREFIX_CACHE_HITS_TOTAL: &str = "vllm:external_prefix_cache_hits_total";
/// vLLM: histogram of the tokens each engine iteration computed (prompt
/// tokens prefilled plus one per decoding stream).
pub const VLLM_ITERATION_TOKENS_TOTAL: &str = "vllm:iteration_tokens_total";
/// vLLM: preemptions (a running request losing its KV to another); the CPU
/// engine never preempts, so it stays 0.
pub const VLLM_NUM_PREEMPTIONS_TOTAL: &str = "vllm:num_preemptions_total";

// Worker timings.
/// KV push on the prefill side, seconds (histogram).
pub const WORKER_KV_SAVE_SECONDS: &str = "rngd_pd_worker_kv_save_seconds";
/// KV pull on the decode side, seconds (histogram).
pub const WORKER_KV_LOAD_SECONDS: &str = "rngd_pd_worker_kv_load_seconds";
/// Prefill compute, seconds (histogram).
pub const WORKER_PREFILL_SECONDS: &str = "rngd_pd_worker_prefill_seconds";
/// Decode speed per request, tokens/s (histogram).
pub const WORKER_DECODE_TOKENS_PER_SECOND: &str = "rngd_pd_worker_decode_tokens_per_second";
/// Prefills run (counter).
pub const WORKER_PREFILLS_TOTAL: &str = "rngd_pd_worker_prefills_total";
/// KV caches loaded from a transport (counter).
pub const WORKER_KV_LOADS_TOTAL: &str = "rngd_pd_worker_kv_loads_total";
/// Requests by outcome (counter, label `status`).
pub const WORKER_REQUESTS_TOTAL: &str = "rngd_pd_worker_requests_total";

// The seed's KPIs (gateway, over the most recent 512 requests).
/// p90 time to first token, ms.
pub const AIRM_TTFT_P90_MS: &str = "airm_ttft_p90_ms";
/// p90 time per output token, ms.
pub const AIRM_TPOT_P90_MS: &str = "airm_tpot_p90_ms";
/// Output tokens per second.
pub const AIRM_TOK_S: &str = "airm_tok_s";
/// Mean KV transfer time, ms, label `kv_transport`.
pub const AIRM_KV_TRANSFER_MS: &str = "airm_kv_transfer_ms";

/// Requests by status code (counter, label `code`).
pub const GATEWAY_REQUESTS_TOTAL: &str = "rngd_pd_gateway_requests_total";
/// Worker calls that failed before any response byte (the connection closed
/// or reset: a worker's idle timer, a stalled worker resuming) and were sent
/// again once on a fresh connection, by `stage` (counter).
pub const GATEWAY_UPSTREAM_RETRIES_TOTAL: &str = "rngd_pd_gateway_upstream_retries_total";
/// Answers moved to another decode worker after theirs died or their
/// stream broke, by `outcome`: `continued` (another worker took it),
/// `failed` (no other worker could; the client got the error) (counter).
pub const GATEWAY_MIGRATIONS_TOTAL: &str = "rngd_pd_gateway_migrations_total";
/// Handoffs whose decode worker could not load the KV (a 410
/// `kv_unavailable` or `kv_handle_consumed`: nothing pulled), by what the gateway's `--kv-load-failure-policy` made of
/// them: `recompute` (served whole on the decode worker) or `fail` (counter).
pub const GATEWAY_KV_LOAD_FAILURES_TOTAL: &str = "rngd_pd_gateway_kv_load_failures_total";
/// PD routes the prefill worker refused with `context_length_exceeded` (its
/// variant holds less context than the gateway's last scrape said) and the
/// decode worker then prefilled itself (counter).
pub const GATEWAY_PREFILL_CONTEXT_FALLBACKS_TOTAL: &str =
    "rngd_pd_gateway_prefill_context_fallbacks_total";

// Policy host.
/// Module reloads that failed (the old module stayed active).
pub const POLICY_RELOAD_FAILURES_TOTAL: &str = "policy_reload_failures_total";
/// Module reloads that succeeded.
pub const POLICY_RELOADS_TOTAL: &str = "policy_reloads_total";
/// Guest traps (request failed with 500, instance discarded).
pub const POLICY_TRAPS_TOTAL: &str = "policy_traps_total";

// Endpoint picker.
/// Picks by result (counter, label `result`).
pub const EPP_PICKS_TOTAL: &str = "rngd_pd_epp_picks_total";
/// Pick latency (body complete → decision), seconds (histogram).
pub const EPP_PICK_SECONDS: &str = "rngd_pd_epp_pick_seconds";
/// Endpoint scrape failures (counter).
pub const EPP_SCRAPE_FAILURES_TOTAL: &str = "rngd_pd_epp_scrape_failures_total";

// The reference endpoint picker's families (Gateway API Inference Extension),
// with its names and labels, so its dashboards and alerts work unchanged.
/// Requests per model (counter; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_REQUEST_TOTAL: &str = "inference_objective_request_total";
/// Refused or failed requests per model (counter; `model_name`,
/// `target_model_name`, `error_code`).
pub const GIE_OBJECTIVE_REQUEST_ERROR_TOTAL: &str = "inference_objective_request_error_total";
/// Request to end of response, seconds (histogram; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_REQUEST_DURATION_SECONDS: &str =
    "inference_objective_request_duration_seconds";
/// Request body size, bytes (histogram; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_REQUEST_SIZES: &str = "inference_objective_request_sizes";
/// Response body size, bytes (histogram; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_RESPONSE_SIZES: &str = "inference_objective_response_sizes";
/// Prompt tokens (histogram; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_INPUT_TOKENS: &str = "inference_objective_input_tokens";
/// Generated tokens, from the response's `usage` (histogram; `model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_OUTPUT_TOKENS: &str = "inference_objective_output_tokens";
/// Requests routed and not yet answered (gauge; `model_name`).
pub const GIE_OBJECTIVE_RUNNING_REQUESTS: &str = "inference_objective_running_requests";
/// Mean `kv_cache_usage_perc` over the pool's healthy endpoints (gauge; `name`).
pub const GIE_POOL_AVERAGE_KV_CACHE_UTILIZATION: &str =
    "inference_pool_average_kv_cache_utilization";
/// Mean queue depth over the pool's healthy endpoints (gauge; `name`).
pub const GIE_POOL_AVERAGE_QUEUE_SIZE: &str = "inference_pool_average_queue_size";
/// Queue depth of each endpoint (gauge; `name`, `model_server_pod`).
pub const GIE_POOL_PER_POD_QUEUE_SIZE: &str = "inference_pool_per_pod_queue_size";
/// Healthy endpoints in the pool (gauge; `name`).
pub const GIE_POOL_READY_PODS: &str = "inference_pool_ready_pods";
/// GIE: a routed request's duration over its generated tokens, seconds
/// (`model_name`, `target_model_name`).
pub const GIE_OBJECTIVE_NORMALIZED_TPOT_SECONDS: &str =
    "inference_objective_normalized_time_per_output_token_seconds";
/// GIE: the scheduler's whole decision for one request, seconds.
pub const GIE_SCHEDULER_E2E_DURATION_SECONDS: &str =
    "inference_extension_scheduler_e2e_duration_seconds";
/// GIE: one plugin's part of a decision, seconds (`extension_point`,
/// `plugin_type`, `plugin_name`).
pub const GIE_PLUGIN_DURATION_SECONDS: &str = "inference_extension_plugin_duration_seconds";
/// GIE: the picker's build, 1 (`commit`, `build_ref`).
pub const GIE_INFO: &str = "inference_extension_info";

// Gateway histograms in base units (what the gateway's `/metrics` exports;
// `promtool check metrics` rejects abbreviated units such as `_ms`).
/// Time to first token, seconds (histogram).
pub const GATEWAY_TTFT_SECONDS: &str = "rngd_pd_gateway_ttft_seconds";
/// Time per output token after the first, seconds (histogram).
pub const GATEWAY_TPOT_SECONDS: &str = "rngd_pd_gateway_tpot_seconds";
/// KV transfer (save + load) as seen end to end, seconds, label `kv_transport` (histogram).
pub const GATEWAY_KV_TRANSFER_SECONDS: &str = "rngd_pd_gateway_kv_transfer_seconds";
/// Policy decision time, seconds (histogram).
pub const GATEWAY_POLICY_DECISION_SECONDS: &str = "rngd_pd_gateway_policy_decision_seconds";

// Pool discovery (the picker's and the gateway's InferencePool watch).
/// Endpoints discovered from the pool's ready pods (gauge).
pub const DISCOVERY_ENDPOINTS: &str = "rngd_pd_discovery_endpoints";
/// Pods of the pool that are not endpoints, by `reason` (`not_ready`, `invalid`) (gauge).
pub const DISCOVERY_SKIPPED_PODS: &str = "rngd_pd_discovery_skipped_pods";
/// Failed list/watch calls of the Kubernetes API, by `resource` (counter).
pub const DISCOVERY_WATCH_ERRORS_TOTAL: &str = "rngd_pd_discovery_watch_errors_total";
/// 1 while the watch has failed for longer than the stale bound (gauge).
pub const DISCOVERY_STALE: &str = "rngd_pd_discovery_stale";

// Policy host: runtime hardening.
/// Rollbacks to the module active before a hot swap, after repeated runtime
/// guest faults of the swapped-in module (counter).
pub const POLICY_ROLLBACKS_TOTAL: &str = "policy_rollbacks_total";
/// Hostcalls refused at a host-side cap, by `cap` (`shared_data`, `headers`,
/// `log_size`, `log_rate`, `metrics`) (counter).
pub const POLICY_HOST_CAP_HITS_TOTAL: &str = "policy_host_cap_hits_total";
/// Admin API requests with a missing or wrong token (counter).
pub const POLICY_ADMIN_AUTH_FAILURES_TOTAL: &str = "policy_admin_auth_failures_total";
/// Admin API requests answered 429 while failed attempts are throttled (counter).
pub const POLICY_ADMIN_THROTTLED_TOTAL: &str = "policy_admin_throttled_total";

// Admission control.
/// Gateway requests being served, policy call to the end of the response (gauge).
pub const GATEWAY_IN_FLIGHT: &str = "rngd_pd_gateway_in_flight";
/// Gateway requests waiting for a serving slot (gauge).
pub const GATEWAY_QUEUED: &str = "rngd_pd_gateway_queued";
/// Gateway requests answered 429 for load, by `reason` (counter).
pub const GATEWAY_OVERLOAD_REJECTIONS_TOTAL: &str = "rngd_pd_gateway_overload_rejections_total";
/// Worker requests answered 429 because its engine queue was full (counter).
pub const WORKER_OVERLOAD_REJECTIONS_TOTAL: &str = "rngd_pd_worker_overload_rejections_total";
/// Worker requests admitted to the engine and not finished (gauge).
pub const WORKER_IN_FLIGHT: &str = "rngd_pd_worker_in_flight";
/// Counter: requests the worker admin API refused, by `reason`
/// (`unauthorized`, `throttled`).
pub const WORKER_ADMIN_REFUSALS_TOTAL: &str = "rngd_pd_worker_admin_refusals_total";

// Endpoint picker: admission and body budget (the picker's bounded work; the
// admission code is `rngd_pool::admission`, shared with the gateway).
/// Picker requests in their request phase (headers to the pick) (gauge).
pub const EPP_IN_FLIGHT: &str = "rngd_pd_epp_in_flight";
/// Picker requests waiting for a slot (gauge).
pub const EPP_QUEUED: &str = "rngd_pd_epp_queued";
/// Picker requests answered 429 for load, by `reason` (`queue_full`,
/// `queue_timeout`, `body_budget`) (counter).
pub const EPP_OVERLOAD_REJECTIONS_TOTAL: &str = "rngd_pd_epp_overload_rejections_total";
/// Request body bytes the picker holds or has reserved (gauge).
pub const EPP_BODY_BYTES_IN_FLIGHT: &str = "rngd_pd_epp_body_bytes_in_flight";

// Prefix cache of the worker's engine (vLLM's families, label `model_name`).
/// Prompt tokens looked up in the prefix cache (counter).
pub const VLLM_PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
/// Prompt tokens found in the prefix cache, not computed (counter).
pub const VLLM_PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";
/// Cache configuration: gauge 1 with labels `model_name`, `block_size`,
/// `num_gpu_blocks` (the blocks the prefix cache's budget holds).
pub const VLLM_CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";

// The weights a worker serves.
/// Gauge 1 with labels `model_name` and `weight_version` (the engine's
/// weights identity, `rngd_engine::identity`): one series, the current one.
pub const WORKER_WEIGHT_INFO: &str = "rngd_pd_worker_weight_info";
/// Gauge 1 for the compiled variant a worker serves now, labels
/// `model_name`, `seq_len`, `max_batch` (`/switch_variant` changes it; the
/// routers read `seq_len` for admission): one series, the current one.
pub const WORKER_VARIANT_INFO: &str = "rngd_pd_worker_variant_info";
/// Gauge 1 for the device a worker serves on, labels `role` (`prefill`,
/// `decode`, `solo`), `backend` (`cpu`, `rngd`, `atom`), `vendor` (the
/// host CPU's for `cpu`: `amd`, `intel`, …; `furiosaai`, `rebellions`) and
/// `device` (`cpu`, `rngd0`, …): the heterogeneous resource count reads it.
pub const WORKER_DEVICE_INFO: &str = "rngd_pd_worker_device_info";
/// Gauge: model FLOPs per token, label `model_name` (2 × the weights each
/// token is multiplied by; attention left out): the MFU figure reads it.
pub const WORKER_MODEL_FLOPS_PER_TOKEN: &str = "rngd_pd_worker_model_flops_per_token";
/// Gauge 1 with labels `model_name` and `digest`: the identity of the
/// worker's tokenizer and chat template (`Tokenizer::digest`), the one a
/// door's `tokenized_prompt` must carry for the worker to use its ids.
pub const WORKER_TOKENIZER_INFO: &str = "rngd_pd_worker_tokenizer_info";
/// Counter: prompts served from a front door's token ids
/// (`tokenized_prompt` under this worker's digest) instead of tokenizing
/// their text again.
pub const WORKER_PROMPT_IDS_REUSED_TOTAL: &str = "rngd_pd_worker_prompt_ids_reused_total";
/// Counter: prompts whose `tokenized_prompt` came under another tokenizer
/// digest than this worker's: the ids were ignored and the text tokenized
/// here (a warning is logged the first time and every 1000th).
pub const WORKER_TOKENIZER_MISMATCH_TOTAL: &str = "rngd_pd_worker_tokenizer_mismatch_total";
/// Counter: PD decodes refused with 410 `kv_unavailable` because their KV
/// could not be loaded, by `reason` (`expired`: the handle's lease was
/// over; `not_found`: its transport no longer holds the KV). Nothing was
/// waited for or pulled; the orchestrator recomputes or fails.
pub const WORKER_KV_LOAD_FAILURES_TOTAL: &str = "rngd_pd_worker_kv_load_failures_total";
/// Counter: requests a decode worker serving `x-prefiller-host-port`
/// recomputed whole because it could not load their KV (its
/// `--kv-load-failure-policy recompute`).
pub const WORKER_KV_RECOMPUTES_TOTAL: &str = "rngd_pd_worker_kv_recomputes_total";
/// Counter: PD decodes refused with 409 because the KV was computed by
/// another `weight_version` (the KV released unpulled).
pub const WORKER_WEIGHT_VERSION_REFUSALS_TOTAL: &str =
    "rngd_pd_worker_weight_version_refusals_total";
/// Counter: `x-prefiller-host-port` requests whose prefill peer refused the
/// prompt with `context_length_exceeded` (its variant holds less context
/// than the router's last scrape said) and which this worker then prefilled
/// itself.
pub const WORKER_PREFILL_CONTEXT_FALLBACKS_TOTAL: &str =
    "rngd_pd_worker_prefill_context_fallbacks_total";
/// Gauge: KV bytes a transport of this worker holds that no decode has
/// claimed (pulled or released) although published longer ago than the
/// claim window (`AIRM_KV_CLAIM_WINDOW_S`), by `transport` (`shm`,
/// `nixl-ucx`); refreshed on each scrape from the transport's last sweep.
/// The TTL frees it; `tcp` KV is the relay's `rngd_pd_relay_stranded_bytes`.
pub const WORKER_KV_STRANDED_BYTES: &str = "rngd_pd_worker_kv_stranded_bytes";
/// Counter: KV handoffs a prefill made, by `path`: `in_place` (the engine
/// wrote its cache straight into the transport's room: a `shm` slot) or
/// `push` (blobs pushed: another transport, or every slot busy).
pub const WORKER_KV_HANDOFFS_TOTAL: &str = "rngd_pd_worker_kv_handoffs_total";

// KV relay pre-auth budget. The relay has no HTTP listener: its STATS reply
// carries these (fields `handshake_failures`, `handshakes`), docs/kv-wire.md.
/// Relay sockets that failed the handshake, by `reason` (`refused`,
/// `timeout`, `evicted`: closed as the oldest over the pre-auth cap) (counter).
pub const RELAY_HANDSHAKE_FAILURES_TOTAL: &str = "rngd_pd_relay_handshake_failures_total";
/// Relay sockets in the handshake now, under the pre-auth cap (gauge).
pub const RELAY_HANDSHAKES: &str = "rngd_pd_relay_handshakes";
/// Relay bytes counted against its memory cap (gauge).
pub const RELAY_BYTES: &str = "rngd_pd_relay_bytes";
/// The relay's memory cap, bytes (gauge).
pub const RELAY_MAX_BYTES: &str = "rngd_pd_relay_max_bytes";
/// Requests with a blob held on the relay (gauge).
pub const RELAY_KEYS: &str = "rngd_pd_relay_keys";
/// Blobs held on the relay (gauge).
pub const RELAY_BLOBS: &str = "rngd_pd_relay_blobs";
/// GETs waiting on the relay (gauge).
pub const RELAY_WAITERS: &str = "rngd_pd_relay_waiters";
/// Authenticated relay connections (gauge).
pub const RELAY_CONNECTIONS: &str = "rngd_pd_relay_connections";
/// PUT bodies the relay is receiving (gauge).
pub const RELAY_PUTS_IN_PROGRESS: &str = "rngd_pd_relay_puts_in_progress";
/// Relay bytes of blobs older than the claim window that no decode took
/// (pulled and deleted), as of the last TTL sweep (gauge).
pub const RELAY_STRANDED_BYTES: &str = "rngd_pd_relay_stranded_bytes";
/// Requests the relay expired by its TTL (counter).
pub const RELAY_EXPIRED_TOTAL: &str = "rngd_pd_relay_expired_total";
/// Relay refusals and forced closes, by `reason` (counter).
pub const RELAY_REJECTIONS_TOTAL: &str = "rngd_pd_relay_rejections_total";
/// Relay warnings held back by its log rate limit (counter).
pub const RELAY_WARNINGS_HELD_BACK_TOTAL: &str = "rngd_pd_relay_warnings_held_back_total";

// The routers' KV-event index and prefix lookups (`rngd_pool::cache`, in the
// gateway's and the picker's `/metrics`). Label `endpoint` is the pool
// member's `ip:port` (series leave with the member).
/// Events applied from an endpoint's stream (counter, label `endpoint`).
pub const KV_INDEX_EVENTS_TOTAL: &str = "rngd_pd_kv_index_events_total";
/// Stream faults by `fault`: `gap`, `replay_failed`, `unknown_parent`,
/// `restart`, `stale`, `undecodable` (counter, labels `endpoint`, `fault`).
pub const KV_INDEX_STREAM_FAULTS_TOTAL: &str = "rngd_pd_kv_index_stream_faults_total";
/// Replays that completed (counter, label `endpoint`).
pub const KV_INDEX_REPLAYS_TOTAL: &str = "rngd_pd_kv_index_replays_total";
/// Blocks indexed now (gauge, label `endpoint`).
pub const KV_INDEX_BLOCKS: &str = "rngd_pd_kv_index_blocks";
/// Blocks evicted by the index's block cap (counter).
pub const KV_INDEX_EVICTED_BLOCKS_TOTAL: &str = "rngd_pd_kv_index_evicted_blocks_total";
/// Seconds since the endpoint's last batch or answered probe (gauge, label
/// `endpoint`; absent before the first).
pub const KV_INDEX_SECONDS_SINCE_EVENT: &str = "rngd_pd_kv_index_seconds_since_event";
/// 1 when the endpoint's stream is live (its cache information is used),
/// else 0 and it is routed on load alone (gauge, label `endpoint`).
pub const KV_INDEX_STREAM_UP: &str = "rngd_pd_kv_index_stream_up";
/// Per-endpoint prefix lookups of routed requests by `result`: `indexed`
/// (from events), `estimated` (approximate mode), `stream_down` (a stream
/// without current information: load alone), `no_stream` (counter).
pub const PREFIX_LOOKUPS_TOTAL: &str = "rngd_pd_prefix_lookups_total";
/// Blocks the router remembers having sent, by `kind`: `speculative`
/// (awaiting events), `approximate` (endpoints without a stream) (gauge).
pub const PREFIX_ESTIMATED_BLOCKS: &str = "rngd_pd_prefix_estimated_blocks";
/// Routes chosen by the policy, by `reason` (`x-rngd-pd-route-reason`:
/// `cached`, `short_prompt`, `ttft_goal_met_locally`, `faster_locally`,
/// `disaggregated`, `unknown_prompt`, `no_prefill_endpoint`,
/// `no_prefill_same_weights`,
/// `no_common_transport`, `solo`; `none` without one, `other` for a reason
/// that is not a short `[a-z0-9_]` word) (counter, both doors).
pub const ROUTE_DECISIONS_TOTAL: &str = "rngd_pd_route_decisions_total";
/// Prompt tokens the router's index predicted cached on the endpoint that
/// prefilled a routed request, counted when the answer's usage arrives
/// (counter, label `endpoint`; both doors).
pub const ROUTER_PREDICTED_CACHED_TOKENS_TOTAL: &str =
    "rngd_pd_router_predicted_cached_tokens_total";
/// Prompt tokens the engine reported cached for the same requests
/// (`usage.prompt_tokens_details.cached_tokens`) (counter, label `endpoint`).
pub const ROUTER_SERVED_CACHED_TOKENS_TOTAL: &str = "rngd_pd_router_served_cached_tokens_total";
/// Served minus predicted cached tokens of one routed request: negative
/// when the index promised more than the engine held (histogram).
pub const ROUTER_CACHED_TOKENS_ERROR: &str = "rngd_pd_router_cached_tokens_prediction_error";
/// Endpoints whose index entries were dropped and rebuilt by replay, by
/// `reason` (`prediction_miss`) (counter).
pub const ROUTER_INDEX_RESYNCS_TOTAL: &str = "rngd_pd_router_index_resyncs_total";
/// Gauge 1 per tokenizer a door knows of, labels `endpoint` and `digest`
/// (`Tokenizer::digest`): the door's own as `endpoint="self"`, each
/// endpoint's as its scrape of `rngd_pd_worker_tokenizer_info` shows it.
pub const ROUTER_TOKENIZER_INFO: &str = "rngd_pd_router_tokenizer_info";
/// Gauge per endpoint (label `endpoint`): 1 when its tokenizer digest
/// differs from the door's (its prefix predictions and the door's ids are
/// of no use there: it tokenizes the text itself), 0 when equal.
pub const ROUTER_TOKENIZER_MISMATCH: &str = "rngd_pd_router_tokenizer_mismatch";

/// Prometheus' process families (every client library's names).
pub const PROCESS_CPU_SECONDS_TOTAL: &str = "process_cpu_seconds_total";
/// Resident memory, bytes.
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
/// Virtual memory, bytes.
pub const PROCESS_VIRTUAL_MEMORY_BYTES: &str = "process_virtual_memory_bytes";
/// Open file descriptors.
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
/// The soft limit of open file descriptors.
pub const PROCESS_MAX_FDS: &str = "process_max_fds";
/// OS threads.
pub const PROCESS_THREADS: &str = "process_threads";
/// Start time since the Unix epoch, seconds.
pub const PROCESS_START_TIME_SECONDS: &str = "process_start_time_seconds";

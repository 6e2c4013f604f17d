//! The configuration as operators meet it: the shipped configs validate, defaults are what the
//! docs say, and each mistake is refused with the file, the key and what was expected.

use std::path::Path;
use std::time::Duration;

use super::*;
use crate::core::model::BuiltinModel;

fn check(yaml: &str) -> Result<Config, ConfigError> {
    parse_yaml::<RawConfig>(yaml, "test.yaml")?.validate("test.yaml", Path::new("."))
}

const BASE: &str = "
models:
  - name: enc
    path: builtin:encoder
pools:
  - name: cpu
    provider: cpu
    models: [enc]
";

#[test]
fn embedded_default_is_valid_on_both_kinds_of_machine() {
    let sim = Config::embedded(false);
    assert!(sim.pools.iter().any(|p| p.provider == Provider::Simulated));
    let gpu = Config::embedded(true);
    assert!(gpu.pools.iter().any(|p| matches!(p.provider, Provider::Cuda(_))));
    assert!(gpu.pools.iter().all(|p| p.provider != Provider::Simulated));
    assert_eq!(
        sim.pools.iter().map(|p| &p.name).collect::<Vec<_>>(),
        gpu.pools.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
    // Lossless first: out of the box no request's context is cut unless the client asks.
    assert!(sim.models.iter().all(|m| !m.allow_shrink));
    // A chat model from the first start: the bundled decoder as `tiny`, with ChatML, on the CPU.
    for config in [&sim, &gpu] {
        let tiny = config.models.iter().find(|m| m.name == "tiny").expect("tiny is served");
        assert_eq!(tiny.source, ModelSource::Builtin(BuiltinModel::Decoder));
        assert_eq!(tiny.tokenizer, Some(TokenizerSource::Builtin(BuiltinModel::Decoder)));
        assert_eq!(
            tiny.chat_template,
            Some(ChatTemplateSource::Builtin(BuiltinChatTemplate::Chatml))
        );
        let serving: Vec<&str> = config
            .pools
            .iter()
            .filter(|p| p.models.iter().any(|m| m == "tiny"))
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(serving, ["cpu"]);
    }
}

#[test]
fn a_builtin_tokenizer_is_one_a_builtin_model_ships() {
    let with = |tokenizer: &str| {
        BASE.replace(
            "path: builtin:encoder",
            &format!("path: builtin:decoder\n    tokenizer: '{tokenizer}'"),
        )
    };
    let cfg = check(&with("builtin:decoder")).unwrap();
    assert_eq!(
        cfg.models[0].tokenizer,
        Some(TokenizerSource::Builtin(BuiltinModel::Decoder))
    );
    assert_eq!(
        check(&with("builtin:encoder")).unwrap_err().to_string(),
        "test.yaml: models[0].tokenizer: no builtin tokenizer `encoder`; builtin tokenizers are: decoder, embedder"
    );
}

#[test]
fn the_example_config_validates_and_uses_every_section() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/example.yaml");
    let cfg = Config::load(&path).unwrap();
    assert_eq!(cfg.devices.len(), 2);
    assert_eq!(cfg.server.admin_token_env.as_deref(), Some("VRAMGUARD_ADMIN_TOKEN"));
    assert_eq!(cfg.server.idempotency.ttl, Duration::from_secs(600));
    // The example shows the connection limits' defaults, so its comments explain them.
    let defaults = check(BASE).unwrap().server;
    assert_eq!(cfg.server.timeouts, defaults.timeouts);
    assert_eq!(cfg.server.max_connections, defaults.max_connections);
    assert_eq!(cfg.server.max_receiving_bytes, defaults.max_receiving_bytes);
    let providers: Vec<&str> = cfg.pools.iter().map(|p| p.provider.label()).collect();
    assert_eq!(providers, ["cuda", "simulated", "cpu", "remote"]);
    let kinds: Vec<&str> = cfg.pools.iter().map(|p| cfg.pool_class(p).label()).collect();
    assert_eq!(kinds, ["nvml", "simulated", "host", "remote"]);
    let limits: Vec<Option<u64>> = cfg.pools.iter().map(|p| p.max_context).collect();
    assert_eq!(limits, [Some(4096), None, None, None]);
    assert_eq!(cfg.exporter.services.len(), 3);
    let services: Vec<(&str, Option<u64>)> = cfg
        .services
        .iter()
        .map(|s| (s.name.as_str(), s.device_memory))
        .collect();
    assert_eq!(
        &services[..2],
        [("search", Some(256 << 20)), ("ollama", Some(8 << 30))],
        "declared first, then the models' implicit ones"
    );
    assert_eq!(cfg.models[0].service, "search");
    assert_eq!(cfg.exporter.sample_interval, Duration::from_secs(1));
    assert_eq!(
        cfg.models[0].context,
        Some(ContextAxis {
            input: "input".into(),
            axis: 1,
            keep: Keep::End
        })
    );
    let allow_shrink: Vec<bool> = cfg.models.iter().map(|m| m.allow_shrink).collect();
    assert_eq!(allow_shrink, [false, false]);
}

#[test]
fn minimal_config_gets_defaults() {
    let cfg = check(BASE).unwrap();
    assert_eq!(cfg.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(cfg.pools[0].device, HOST_DEVICE);
    assert_eq!(cfg.pools[0].queue_capacity, 64);
    assert_eq!(cfg.pools[0].max_context, None);
    assert_eq!(
        cfg.server.idempotency,
        IdempotencyConfig {
            max_entries: 10_000,
            ttl: Duration::from_secs(600)
        }
    );
    assert!(!cfg.models[0].allow_shrink);
    let allowed = BASE.replace("builtin:encoder", "builtin:encoder\n    allow_shrink: true");
    assert!(check(&allowed).unwrap().models[0].allow_shrink);
}

#[test]
fn idempotency_bounds_are_checked_with_their_key() {
    let cfg = check(&format!(
        "server:\n  idempotency: {{max_entries: 50, ttl: 30s}}\n{BASE}"
    ))
    .unwrap();
    assert_eq!(cfg.server.idempotency.max_entries, 50);
    assert_eq!(cfg.server.idempotency.ttl, Duration::from_secs(30));
    let err = check(&format!("server:\n  idempotency: {{max_entries: 0}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "test.yaml: server.idempotency.max_entries: expected 1 to 1000000, got 0"
    );
    let err = check(&format!("server:\n  idempotency: {{ttl: 2d}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("server.idempotency.ttl") && err.contains("`2d`"), "{err}");
    let err = check(&format!("server:\n  idempotency: {{ttl: 25h}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: server.idempotency.ttl: expected 1s to 24h, got 25h");
    let err = check(&format!("server:\n  idempotency: {{max_entires: 5}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: server.idempotency: unknown field `max_entires`"),
        "{err}"
    );
}

#[test]
fn connection_limits_default_near_nginx_and_refuse_zero_with_their_key() {
    let server = check(BASE).unwrap().server;
    assert_eq!(
        server.timeouts,
        Timeouts {
            header_read: Duration::from_secs(20),
            body_read: Duration::from_secs(30),
            idle: Duration::from_secs(75),
        }
    );
    assert_eq!(server.max_connections, 512);
    assert_eq!(server.max_receiving_bytes, 256 << 20);
    let cfg = check(&format!(
        "server:\n  timeouts: {{header_read: 500ms, idle: 2m}}\n  max_connections: 8\n{BASE}"
    ))
    .unwrap();
    assert_eq!(cfg.server.timeouts.header_read, Duration::from_millis(500));
    assert_eq!(cfg.server.timeouts.body_read, Duration::from_secs(30));
    assert_eq!(cfg.server.timeouts.idle, Duration::from_secs(120));
    assert_eq!(cfg.server.max_connections, 8);
    for key in ["header_read", "body_read", "idle"] {
        let err = check(&format!("server:\n  timeouts: {{{key}: 0}}\n{BASE}"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("test.yaml: server.timeouts.{key}: expected 1ms to 24h, got 0ms")
        );
    }
    let err = check(&format!("server:\n  timeouts: {{idle: 48h}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: server.timeouts.idle: expected 1ms to 24h, got 48h");
    let err = check(&format!("server:\n  max_connections: 0\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: server.max_connections: expected 1 to 1000000, got 0");
    let err = check(&format!("server:\n  max_receiving_bytes: 1MiB\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: server.max_receiving_bytes: must be at least server.body_limit (64MiB)"),
        "{err}"
    );
    let err = check(&format!("server:\n  timeouts: {{header: 5s}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: server.timeouts: unknown field `header`"),
        "{err}"
    );
}

#[test]
fn unknown_keys_are_refused_with_their_path_and_line() {
    let err = check(&format!("{BASE}    wrokers: 2\n")).unwrap_err().to_string();
    assert!(err.starts_with("test.yaml: pools[0]: unknown field `wrokers`"), "{err}");
    assert!(err.contains("line 9"), "{err}");
}

#[test]
fn impossible_values_name_the_key() {
    let err = check(&format!("{BASE}    queue: {{capacity: 0}}\n"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: pools[0].queue.capacity: expected 1 to 1000000, got 0");
    let err = check(&BASE.replace("[enc]", "[nope]")).unwrap_err().to_string();
    assert_eq!(err, "test.yaml: pools[0].models[0]: no model named `nope` in `models`");
    let err = check(&BASE.replace("builtin:encoder", "builtin:bert"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: models[0].path: no builtin model `bert`"),
        "{err}"
    );
    let err = check(&BASE.replace("builtin:encoder", "missing.onnx"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("models[0].path: model file `./missing.onnx` does not exist"),
        "{err}"
    );
}

#[test]
fn max_context_is_a_positive_number_of_tokens() {
    let cfg = check(&format!("{BASE}    max_context: 2048\n")).unwrap();
    assert_eq!(cfg.pools[0].max_context, Some(2048));
    let err = check(&format!("{BASE}    max_context: 0\n")).unwrap_err().to_string();
    assert_eq!(
        err,
        "test.yaml: pools[0].max_context: expected at least 1 token; leave it out for no limit"
    );
    let err = check(&format!("{BASE}    max_context: -1\n")).unwrap_err().to_string();
    assert!(
        err.starts_with("test.yaml: pools[0].max_context: invalid type: integer `-1`, expected u64 at line 9"),
        "{err}"
    );
}

#[test]
fn sizes_and_durations_in_the_wrong_shape_are_explained() {
    let err = check(&format!("server:\n  body_limit: huge\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("server.body_limit") && err.contains("`huge`"), "{err}");
    let err = check(&format!("{BASE}    queue: {{max_wait: soon}}\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("pools[0].queue.max_wait") && err.contains("`soon`"),
        "{err}"
    );
}

#[test]
fn words_from_a_closed_set_are_refused_with_the_accepted_ones_and_the_line() {
    let err = check(&BASE.replace("provider: cpu", "provider: gpu"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "test.yaml: pools[0].provider: unknown variant `gpu`, expected one of `cpu`, `cuda`, `simulated`, `remote` \
             at line 7 column 15"
    );
    let err = check(&format!("devices: [{{name: d, kind: amd}}]\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "test.yaml: devices[0].kind: unknown variant `amd`, expected `nvidia` or `simulated` at line 1 column 27"
    );
    let err = check(&BASE.replace(
        "builtin:encoder",
        "builtin:encoder\n    context: {input: input, axis: 1, keep: End}",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with(
            "test.yaml: models[0].context.keep: unknown variant `End`, expected `start` or `end` at line 5"
        ),
        "{err}"
    );
    let cuda = BASE.replace(
        "provider: cpu",
        "provider: cuda\n    device: g\n    cuda: {arena_extend_strategy: lots}",
    );
    let err = check(&format!("devices: [{{name: g, kind: nvidia}}]\n{cuda}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "test.yaml: pools[0].cuda.arena_extend_strategy: unknown variant `lots`, \
                 expected `next_power_of_two` or `same_as_requested`"
        ),
        "{err}"
    );
    let err = check(&format!("policy: {{fallback: {{action: admitt}}}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: policy.fallback.action: unknown variant `admitt`, expected one of `admit`"),
        "{err}"
    );
}

#[test]
fn pools_must_match_their_device_kind() {
    let yaml = "
devices:
  - {name: sim0, kind: simulated, capacity: 64MiB}
models:
  - {name: enc, path: 'builtin:encoder'}
pools:
  - {name: gpu, provider: cuda, device: sim0, models: [enc]}
";
    let err = check(yaml).unwrap_err().to_string();
    assert_eq!(err, "test.yaml: pools[0].device: `sim0` is not an `nvidia` device");
    let err = check(&yaml.replace("capacity: 64MiB", "capacity: 1KiB"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: devices[0].capacity: must be at least 1MiB");
}

#[test]
fn cpus_are_cpu_lists_and_bad_ones_name_their_key() {
    let cfg = check(
        &format!("server: {{cpus: '0-2,5'}}\n{BASE}").replace("provider: cpu", "provider: cpu\n    cpus: [1, 3]"),
    )
    .unwrap();
    assert_eq!(
        cfg.server.cpus.as_ref().map(ToString::to_string).as_deref(),
        Some("0-2,5")
    );
    assert_eq!(
        cfg.pools[0].cpus.as_ref().map(ToString::to_string).as_deref(),
        Some("1,3")
    );
    assert_eq!(check(BASE).unwrap().pools[0].cpus, None);
    let err = check(&BASE.replace("provider: cpu", "provider: cpu\n    cpus: '3-1'"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: pools[0].cpus: the range `3-1` in `3-1` runs backwards"),
        "{err}"
    );
    let err = check(&format!("server: {{cpus: 'all'}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.yaml: server.cpus: `all` in `all` is not a CPU number"),
        "{err}"
    );
    let err = check(&format!("server: {{cpus: {{first: 1}}}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("server.cpus: invalid type: map, expected a CPU list"),
        "{err}"
    );
}

#[test]
fn a_cpu_wake_latency_is_a_duration_up_to_100ms() {
    assert_eq!(check(BASE).unwrap().server.cpu_wake_latency, None);
    for (text, want) in [("0us", 0), ("20us", 20), ("100ms", 100_000)] {
        let cfg = check(&format!("server: {{cpu_wake_latency: {text}}}\n{BASE}")).unwrap();
        assert_eq!(cfg.server.cpu_wake_latency, Some(Duration::from_micros(want)), "{text}");
    }
    let err = check(&format!("server: {{cpu_wake_latency: 1s}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: server.cpu_wake_latency: expected 0ms to 100ms, got 1s");
    let err = check(&format!("server: {{cpu_wake_latency: soon}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("test.yaml: server.cpu_wake_latency: "), "{err}");
}

#[test]
fn a_remote_pool_needs_a_plain_http_url_and_no_onnxruntime_settings() {
    let pool = |extra: &str| {
        check(&format!(
            "models: [{{name: enc, path: 'builtin:encoder'}}]\npools:\n  - {{name: far, provider: remote, models: [enc]{extra}}}\n"
        ))
    };
    let err = |extra: &str| pool(extra).unwrap_err().to_string();
    let ok = pool(", url: 'http://10.0.0.2:8080/kserve/', remote: {timeout: 5s}").unwrap();
    let far = &ok.pools[0];
    assert_eq!(far.device, "10.0.0.2:8080");
    assert_eq!(ok.pool_class(far), crate::core::snapshot::DeviceClass::Remote);
    let Provider::Remote(options) = &far.provider else {
        panic!("{:?}", far.provider)
    };
    assert_eq!(options.url, "http://10.0.0.2:8080/kserve");
    assert_eq!(options.timeout, Duration::from_secs(5));
    assert_eq!(options.health_interval, Duration::from_secs(1));
    assert_eq!(
        err(""),
        "test.yaml: pools[0].url: a `remote` pool needs the url of the server it forwards to (http://host:port)"
    );
    assert!(err(", url: 'https://h:1'").starts_with("test.yaml: pools[0].url: `https://h:1` uses https"));
    assert!(err(", url: 'ftp://h:1'").starts_with("test.yaml: pools[0].url: `ftp://h:1` is not an http:// URL"));
    assert!(err(", url: 'http://u:p@h:1'").contains("carries credentials"));
    let device = err(", url: 'http://h:1', device: sim0");
    assert!(
        device.starts_with("test.yaml: pools[0].device: a `remote` pool runs on the remote server"),
        "{device}"
    );
    assert!(err(", url: 'http://h:1', intra_threads: 2").starts_with("test.yaml: pools[0].intra_threads: "));
    assert!(err(", url: 'http://h:1', memory: {arena_shrinkage: true}").starts_with("test.yaml: pools[0].memory: "));
    assert!(err(", url: 'http://h:1', cpus: '0'").starts_with("test.yaml: pools[0].cpus: a `remote` pool runs on"));
    assert_eq!(
        err(", url: 'http://h:1', remote: {health_interval: 0}"),
        "test.yaml: pools[0].remote.health_interval: must be longer than 0"
    );
    let local = BASE.replace("provider: cpu", "provider: cpu\n    url: 'http://h:1'");
    assert_eq!(
        check(&local).unwrap_err().to_string(),
        "test.yaml: pools[0].url: only `remote` pools take a url"
    );
}

#[test]
fn service_rules_need_exactly_one_valid_matcher() {
    let err = check(&format!("exporter:\n  services: [{{service: x}}]\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "test.yaml: exporter.services[0]: give exactly one of `process_name`, `cmdline` or `cgroup`"
    );
    let err = check(&format!(
        "exporter:\n  services: [{{service: x, cmdline: '('}}]\n{BASE}"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("test.yaml: exporter.services[0].cmdline: invalid regular expression"),
        "{err}"
    );
}

#[test]
fn exporter_mode_needs_no_models_or_pools() {
    let raw: RawConfig = parse_yaml("devices: []\n", "e.yaml").unwrap();
    assert!(raw.validate_for("e.yaml", Path::new("."), Mode::Exporter).is_ok());
    let err = raw.validate("e.yaml", Path::new(".")).unwrap_err().to_string();
    assert_eq!(err, "e.yaml: models: at least one model is needed");
}

#[test]
fn duplicate_names_are_refused() {
    let err = check(&format!("{BASE}  - name: cpu\n    provider: cpu\n    models: [enc]\n"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: pools[1].name: `cpu` is defined twice");
}

#[test]
fn builtin_names_are_checked_against_what_the_binary_ships() {
    let cfg = check(&format!("policy: {{path: 'builtin:latency-first'}}\n{BASE}")).unwrap();
    assert_eq!(cfg.policy.source, PolicySource::Builtin(BuiltinPolicy::LatencyFirst));
    let err = check(&format!("policy: {{path: 'builtin:fastest'}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "test.yaml: policy.path: no builtin policy `fastest`; builtin policies are: default, latency-first, availability-first"
    );
    let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let chat = |template: &str| {
        check(&BASE.replace(
            "builtin:encoder",
            &format!(
                "builtin:encoder\n    tokenizer: '{}'\n    chat_template: '{template}'",
                tokenizer.display()
            ),
        ))
    };
    let cfg = chat("builtin:chatml").unwrap();
    let template = cfg.models[0].chat_template.as_ref().expect("a chat template");
    assert_eq!(template, &ChatTemplateSource::Builtin(BuiltinChatTemplate::Chatml));
    assert_eq!(template.to_string(), "builtin:chatml");
    assert_eq!(
        chat("builtin:llama").unwrap_err().to_string(),
        "test.yaml: models[0].chat_template: unknown builtin chat template `llama`; builtin: chatml"
    );
}

#[test]
fn residency_defaults_to_resident_and_a_misspelt_one_names_its_key() {
    assert_eq!(check(BASE).unwrap().models[0].residency, Residency::Resident);
    let lazy = BASE.replace(
        "path: builtin:encoder",
        "path: builtin:encoder\n    residency: on_demand",
    );
    assert_eq!(check(&lazy).unwrap().models[0].residency, Residency::OnDemand);
    let pinned = BASE.replace("path: builtin:encoder", "path: builtin:encoder\n    residency: pinned");
    assert_eq!(check(&pinned).unwrap().models[0].residency, Residency::Pinned);
    let wrong = BASE.replace("path: builtin:encoder", "path: builtin:encoder\n    residency: lazy");
    let err = check(&wrong).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "test.yaml: models[0].residency: unknown variant `lazy`, expected one of `resident`, `pinned`, `on_demand`"
        ),
        "{err}"
    );
}

#[test]
fn idle_unload_is_a_duration_refused_on_a_pinned_model_with_its_key() {
    assert_eq!(check(BASE).unwrap().models[0].idle_unload, None, "absent: never");
    let with = |rest: &str| BASE.replace("path: builtin:encoder", &format!("path: builtin:encoder\n    {rest}"));
    assert_eq!(
        check(&with("idle_unload: 10m")).unwrap().models[0].idle_unload,
        Some(std::time::Duration::from_secs(600))
    );
    assert_eq!(
        check(&with("idle_unload: 2s\n    residency: pinned"))
            .unwrap_err()
            .to_string(),
        "test.yaml: models[0].idle_unload: a pinned model is never unloaded: drop idle_unload or the pin"
    );
    assert_eq!(
        check(&with("idle_unload: 0s")).unwrap_err().to_string(),
        "test.yaml: models[0].idle_unload: must be longer than 0"
    );
}

#[test]
fn services_give_models_their_budget_priority_and_class() {
    let yaml = format!(
        "services:\n  - {{name: chat, device_memory: 6GiB, concurrency: 4, priority: 10, class: interactive}}\n  - {{name: batch, class: background}}\n{}",
        BASE.replace(
            "path: builtin:encoder",
            "path: builtin:encoder\n    service: chat\n  - name: cls\n    path: builtin:classifier\n    priority: 3\n    fallback_model: enc\n    min_residency: 5s"
        )
        .replace("models: [enc]", "models: [enc, cls]")
    );
    let cfg = check(&yaml).unwrap();
    let (enc, cls) = (&cfg.models[0], &cfg.models[1]);
    assert_eq!(
        (enc.service.as_str(), enc.priority),
        ("chat", 10),
        "a model takes its service's priority"
    );
    assert_eq!(enc.min_residency, DEFAULT_MIN_RESIDENCY);
    assert_eq!(
        (cls.service.as_str(), cls.priority),
        ("cls", 3),
        "its own name and priority by default"
    );
    assert_eq!(cls.fallback_model.as_deref(), Some("enc"));
    assert_eq!(cls.min_residency, Duration::from_secs(5));
    assert!(
        !cls.allow_substitute,
        "another model changes the answer: off unless asked"
    );
    let chat = &cfg.services[0];
    assert_eq!((chat.device_memory, chat.concurrency), (Some(6 << 30), Some(4)));
    assert_eq!(cfg.services[1].class, ServiceClass::Background);
    let implicit = cfg
        .services
        .iter()
        .find(|s| s.name == "cls")
        .expect("an implicit service per model");
    assert!(!implicit.configured && implicit.device_memory.is_none());
}

#[test]
fn service_and_fallback_mistakes_name_their_key() {
    let with = |rest: &str| BASE.replace("path: builtin:encoder", &format!("path: builtin:encoder\n    {rest}"));
    let err = |yaml: &str| check(yaml).unwrap_err().to_string();
    assert_eq!(
        err(&with("service: chat")),
        "test.yaml: models[0].service: no service `chat`: declare it under `services:`"
    );
    assert_eq!(
        err(&format!("services: [{{name: web}}]\n{}", with("service: chat"))),
        "test.yaml: models[0].service: no service `chat`; services are: web"
    );
    assert_eq!(
        err(&with("fallback_model: enc")),
        "test.yaml: models[0].fallback_model: a model cannot be its own fallback"
    );
    assert_eq!(
        err(&with("fallback_model: small")),
        "test.yaml: models[0].fallback_model: no model `small`; models are: enc"
    );
    assert_eq!(
        err(&with("images: enc")),
        "test.yaml: models[0].images: a model cannot be its own vision tower"
    );
    assert_eq!(
        err(&with("images: vision")),
        "test.yaml: models[0].images: no model `vision`; models are: enc"
    );
    assert_eq!(
        err(&format!("services: [{{name: a, concurrency: 0}}]\n{BASE}")),
        "test.yaml: services[0].concurrency: must be at least 1 (leave it out for no limit)"
    );
    assert_eq!(
        err(&format!("services: [{{name: a}}, {{name: a}}]\n{BASE}")),
        "test.yaml: services[1].name: `a` is defined twice"
    );
}

#[test]
fn batching_takes_a_batch_size_and_a_delay_and_names_its_key_when_wrong() {
    let with = |rest: &str| BASE.replace("path: builtin:encoder", &format!("path: builtin:encoder\n    {rest}"));
    let cfg = check(&with("batching: {max_batch: 16, max_delay: 5ms}")).unwrap();
    assert_eq!(
        cfg.models[0].batching,
        Some(crate::config::Batching {
            max_batch: 16,
            max_delay: Duration::from_millis(5)
        })
    );
    assert_eq!(check(BASE).unwrap().models[0].batching, None);
    let err = |yaml: &str| check(yaml).unwrap_err().to_string();
    assert_eq!(
        err(&with("batching: {max_batch: 0, max_delay: 5ms}")),
        "test.yaml: models[0].batching.max_batch: must be at least 1"
    );
    assert_eq!(
        err(&with("batching: {max_batch: 8, max_delay: 0ms}")),
        "test.yaml: models[0].batching.max_delay: must be longer than 0"
    );
    assert!(err(&with("batching: {max_batch: 8}")).contains("max_delay"));
}

#[test]
fn the_host_tier_refuses_what_it_cannot_do() {
    let warm_resident = BASE.replace("path: builtin:encoder", "path: builtin:encoder\n    host_tier: warm");
    let err = check(&warm_resident).unwrap_err().to_string();
    assert_eq!(
        err,
        "test.yaml: models[0].host_tier: `warm` pre-warms an on_demand model; a resident model's sessions are built at start"
    );
    let err = check(&format!("host: {{optimized_cache: Cargo.toml}}\n{BASE}"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "test.yaml: host.optimized_cache: ./Cargo.toml is not a folder");
    let config = check(&format!("host: {{model_cache: 1GiB, reserve: 1GiB}}\n{BASE}")).unwrap();
    assert_eq!(config.host_tier.budget_on(8 << 30, 1 << 30), 1 << 30);
    let default = check(BASE).unwrap();
    assert_eq!(
        default.host_tier.budget_on(9 << 30, 1 << 30),
        2 << 30,
        "a quarter above the reserve"
    );
}

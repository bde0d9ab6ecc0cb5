"""/metrics speaks the Gateway API Inference Extension's model-server protocol: the pod's queue,
running requests and KV-cache usage under the names its endpoint picker reads (vLLM's), one
series for the whole daemon beside yaied's per-engine ones, and an empty LoRA report."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from yaied.server.metrics import ServerMetrics


def scrape(metrics: ServerMetrics) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_the_picker_reads_the_pods_totals_under_its_names():
    engines = {
        "0": {"num_requests_waiting": 3, "num_requests_running": 2, "num_pages": 10,
              "num_free_pages": 5},
        "1": {"num_requests_waiting": 1, "num_requests_running": 4, "num_pages": 10,
              "num_free_pages": 9},
    }  # fmt: skip
    samples = scrape(ServerMetrics("smol", lambda: engines))
    (waiting,) = samples["vllm:num_requests_waiting"]
    assert waiting.value == 4 and waiting.labels == {"model_name": "smol"}
    assert samples["vllm:num_requests_running"][0].value == 6
    # usage is a ratio: averaged over the engines (0.5 and 0.1), under both names pickers read
    assert abs(samples["vllm:kv_cache_usage_perc"][0].value - 0.3) < 1e-9
    assert abs(samples["vllm:gpu_cache_usage_perc"][0].value - 0.3) < 1e-9
    (lora,) = samples["vllm:lora_requests_info"]
    assert lora.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                           "max_lora": "0"}  # fmt: skip
    # yaied's own names stay per engine
    assert len(samples["yaied:num_requests_waiting"]) == 2


def test_nothing_before_an_engine_has_loaded():
    samples = scrape(ServerMetrics("smol", lambda: None))
    assert "vllm:num_requests_waiting" not in samples

"""FLOPs and MFU arithmetic against values worked out by hand for BERT-base."""

import pytest
from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

from amp_recipes.measure.flops import (
    device_peak_tflops,
    forward_flops_by_module,
    matmul_parameters,
    mfu,
    training_flops_per_step,
)


def test_bert_base_matmul_parameters():
    model = AutoModelForSequenceClassification.from_config(BertConfig(num_labels=2))
    # 109,483,778 parameters in all, minus the embedding tables:
    # word 30522*768 + position 512*768 + token type 2*768 = 23,835,648.
    assert sum(p.numel() for p in model.parameters()) == 109_483_778
    assert matmul_parameters(model) == 85_648_130


def test_bert_base_training_flops_at_batch_32_seq_128():
    # tokens = 32 * 128 = 4096
    # 6 * 85,648,130 * 4096          = 2,104,888,442,880
    # 12 * 12 * 768 * 128 * 4096     =    57,982,058,496
    assert training_flops_per_step(85_648_130, 12, 768, 32, 128) == 2_162_870_501_376


def test_mfu_on_a_known_gpu():
    peak = device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989.4
    # 2.1629e12 FLOPs in 10 ms = 216.3 TFLOP/s = 21.86% of 989.4
    assert mfu(2_162_870_501_376, 0.010, peak) == pytest.approx(0.218604, rel=1e-5)


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("NVIDIA H100 PCIe", "fp16", 756.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA H200 NVL", "bf16", 835.5),  # not the SXM part's 989.4
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla T4", "bf16", None),  # no bf16 units
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("NVIDIA L40S", "fp16", None),  # not an L4
        ("NVIDIA A10", "tf32", 62.5),
        ("AMD EPYC", "fp32", None),  # unknown device: MFU omitted
    ],
)
def test_device_peaks(name, precision, expected):
    assert device_peak_tflops(name, precision) == expected


def test_mfu_is_omitted_without_a_known_peak():
    assert mfu(1e12, 0.01, None) is None


def test_forward_flops_by_module_at_bert_base_seq_128():
    """Counted on the meta device; every figure worked out by hand for one sequence of 128 tokens."""
    counts = forward_flops_by_module(BertForSequenceClassification, BertConfig(num_labels=2), 128)
    # A Linear on every token: 2 * 128 * in * out FLOPs.
    assert counts["bert.encoder.layer.0.attention.self.query"] == 2 * 128 * 768 * 768
    assert counts["bert.encoder.layer.11.intermediate.dense"] == 2 * 128 * 768 * 3072
    # The pooler and the classifier see the [CLS] token only.
    assert counts["bert.pooler.dense"] == 2 * 768 * 768
    assert counts["classifier"] == 2 * 768 * 2
    # Attention's own matmuls (scores QK^T and the weighted sum AV): 2 * 2 * 128^2 * 768 a layer.
    linear_per_layer = 2 * 128 * (4 * 768 * 768 + 2 * 768 * 3072)
    attention_per_layer = 2 * 2 * 128 * 128 * 768
    assert counts["bert.encoder.layer.3"] == linear_per_layer + attention_per_layer
    assert counts[""] == 12 * (linear_per_layer + attention_per_layer) + 2 * 768 * 768 + 2 * 768 * 2


def test_no_peak_for_fp8_its_flops_run_at_two_rates():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") is None

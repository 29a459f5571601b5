"""The representative subset CI runs (tests/bench/test_conformance_subset.py): each failure class the
suite found, plus the everyday ops, about a minute on 2 cores (``python -m bench.conformance --subset``)."""

from __future__ import annotations

SUBSET = [
    # everyday NPU ops
    "test_conv_with_strides_padding", "test_relu", "test_add_bcast", "test_matmul_2d", "test_gemm_default_scalar_bias",
    "test_averagepool_2d_pads", "test_maxpool_2d_default", "test_sigmoid", "test_concat_3d_axis_1", "test_transpose_all_permutations_0",
    "test_layer_normalization_2d_axis1", "test_softmax_axis_1", "test_resize_upsample_scales_nearest",
    # other input types: float16 (a constant folded in float32 differs by an ulp), float64, uint8
    "test_attention_4d_fp16_expanded", "test_max_float64", "test_min_uint8",
    # scalar (rank-0) inputs and outputs: build, pulsar run files, simulator
    "test_clip", "test_clip_default_min", "test_pow_types_float32_int64", "test_range_float_type_positive_delta",
    "test_dropout_default_ratio", "test_dynamicquantizelinear_expanded", "test_nllloss_NCd1_weight_expanded",
    # sequence / optional / empty interfaces: refused at build time
    "test_split_to_sequence_nokeepdims", "test_if_seq", "test_reduce_sum_empty_axes_input_noop",
    # opset conversion: opset 8 Scan keeps its input shapes; an opset-28 model ends where onnxruntime runs Q/DQ
    "test_scan_sum", "test_celu_expanded", "test_affine_grid_2d_expanded",
    # large numbers and masks
    "test_logsoftmax_large_number_expanded", "test_softmax_large_number_expanded",
    "test_attention_4d_softcap_neginf_mask_poison_expanded", "test_attention_4d_causal_expanded",
    # non-finite inputs read by float ops only; a random op
    "test_isinf", "test_isnan", "test_training_dropout",
    # onnxruntime itself cannot run it
    "test_simple_rnn_batchwise",
]

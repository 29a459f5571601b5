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

# The torch executor's CI subset (tests/bench/test_torch_conformance.py): the ONNX subset plus a test or
# two of each op family fine-tuning must run (``python -m bench.conformance.torch_exec --subset``)
TORCH_SUBSET = [
    *SUBSET,
    # recurrent, control flow
    "test_lstm_with_peepholes", "test_gru_seq_length", "test_rnn_seq_length", "test_simple_rnn_defaults",
    "test_scan9_sum", "test_loop11", "test_if", "test_range_float_type_positive_delta_expanded",
    # resampling, transposed convolution, pooling
    "test_resize_upsample_scales_linear", "test_resize_downsample_scales_cubic", "test_resize_tf_crop_and_resize",
    "test_resize_upsample_sizes_nearest_floor_align_corners", "test_convtranspose_output_shape",
    "test_convtranspose_autopad_same", "test_averagepool_2d_same_upper", "test_maxpool_with_argmax_2d_precomputed_pads",
    "test_gridsample_bilinear", "test_instancenorm_example", "test_group_normalization_example",
    # index, shape, reductions, comparisons, casts
    "test_gather_elements_negative_indices", "test_gathernd_example_int32_batch_dim1", "test_scatter_elements_with_reduction_max",
    "test_scatternd_add", "test_reflect_pad", "test_edge_pad", "test_wrap_pad", "test_slice_neg_steps",
    "test_einsum_batch_matmul", "test_cumsum_1d_reverse_exclusive", "test_top_k", "test_nonzero_example",
    "test_reduce_log_sum_exp_keepdims_random", "test_argmax_keepdims_random_select_last_index",
    "test_cast_FLOAT_to_DOUBLE", "test_cast_FLOAT_to_FLOAT16", "test_castlike_FLOAT16_to_FLOAT_expanded", "test_where_long_example", "test_equal",
    "test_less_equal_bcast", "test_mod_mixed_sign_int32", "test_round", "test_bitshift_right_uint16",
    "test_quantizelinear_axis", "test_dequantizelinear_blocked", "test_onehot_with_axis", "test_tril",
    "test_depthtospace_crd_mode_example", "test_nllloss_NCd1d2_with_weight_reduction_mean",
    # transformer ops
    "test_attention_3d_gqa", "test_rotary_embedding", "test_rms_normalization_2d_axis1", "test_layer_normalization_4d_axis1",
    "test_dft", "test_stft",
]

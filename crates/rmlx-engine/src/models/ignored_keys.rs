//! config.json keys of the supported releases that no part of the loader reads, one reason
//! each. The key-coverage test (tests/release_configs.rs) fails on any other unread key, on a
//! key listed here that no release leaves unread, and on any text-model key here that the
//! README of tests/fixtures/real-configs tables as a structural switch.

pub const IGNORED_CONFIG_KEYS: &[(&str, &str)] = &[
    // transformers bookkeeping
    (
        "architectures",
        "the transformers class name; `model_type` picks the family",
    ),
    (
        "transformers_version",
        "the library version that wrote the file",
    ),
    (
        "torch_dtype",
        "each tensor's own dtype in the safetensors header decides",
    ),
    (
        "dtype",
        "transformers 5's name for torch_dtype; the tensors' dtypes decide",
    ),
    (
        "text_config.dtype",
        "as `dtype`: the tensors' dtypes decide",
    ),
    (
        "vision_config.dtype",
        "as `dtype`: the tensors' dtypes decide",
    ),
    (
        "initializer_range",
        "random initialisation for training only",
    ),
    (
        "text_config.initializer_range",
        "random initialisation for training only",
    ),
    (
        "vision_config.initializer_range",
        "random initialisation for training only",
    ),
    ("use_cache", "generation always keeps a KV cache"),
    (
        "text_config.use_cache",
        "generation always keeps a KV cache",
    ),
    ("attention_dropout", "dropout is off at inference"),
    (
        "text_config.attention_dropout",
        "dropout is off at inference",
    ),
    (
        "vision_config.attention_dropout",
        "dropout is off at inference",
    ),
    (
        "output_router_logits",
        "returns router logits for the training loss",
    ),
    (
        "router_aux_loss_coef",
        "weight of the load-balancing loss in training",
    ),
    (
        "text_config.output_router_logits",
        "returns router logits for the training loss",
    ),
    (
        "text_config.router_aux_loss_coef",
        "weight of the load-balancing loss in training",
    ),
    (
        "text_config.model_type",
        "the sub-model's class tag; the outer model_type picks the family",
    ),
    (
        "vision_config.model_type",
        "the tower's class tag; the outer model_type picks the family",
    ),
    (
        "vision_config._name_or_path",
        "where transformers loaded the sub-config from",
    ),
    (
        "vision_config.architectures",
        "the tower's transformers class name",
    ),
    (
        "vision_config.chunk_size_feed_forward",
        "a transformers memory option for training",
    ),
    (
        "vision_config.is_encoder_decoder",
        "transformers PretrainedConfig default, always false",
    ),
    (
        "vision_config.id2label",
        "classification-head labels; no such head is used",
    ),
    (
        "vision_config.label2id",
        "classification-head labels; no such head is used",
    ),
    (
        "vision_config.problem_type",
        "classification-head loss type; no such head is used",
    ),
    (
        "vision_config.output_attentions",
        "transformers output switch for debugging",
    ),
    (
        "vision_config.output_hidden_states",
        "transformers output switch for debugging",
    ),
    (
        "vision_config.return_dict",
        "transformers output container switch",
    ),
    // token ids the tokenizer files and generation_config.json own
    (
        "bos_token_id",
        "BOS comes from the tokenizer config and chat template (Qwen adds none)",
    ),
    (
        "text_config.bos_token_id",
        "BOS comes from the tokenizer config and chat template",
    ),
    (
        "text_config.eos_token_id",
        "stop ids come from the top-level eos_token_id and generation_config.json",
    ),
    (
        "text_config.pad_token_id",
        "no padding: sequences run unpadded",
    ),
    (
        "boi_token_id",
        "Gemma's begin-of-image text token; the chat template writes it",
    ),
    (
        "eoi_token_id",
        "Gemma's end-of-image text token; the chat template writes it",
    ),
    (
        "boa_token_id",
        "Gemma's begin-of-audio token; audio input is refused before rendering",
    ),
    (
        "eoa_token_id",
        "Gemma's end-of-audio token; audio input is refused before rendering",
    ),
    (
        "eoa_token_index",
        "alias of eoa_token_id; audio input is refused before rendering",
    ),
    // sizes the preprocessing takes from processor_config.json
    (
        "vision_soft_tokens_per_image",
        "the image budget comes from processor_config.json max_soft_tokens, as mlx-vlm's processor",
    ),
    (
        "vision_config.default_output_length",
        "the pooler's length follows the image's budget from processor_config.json",
    ),
    (
        "vision_config.max_position_embeddings",
        "the tower's positions come from position_embedding_size",
    ),
    (
        "vision_config.global_head_dim",
        "mlx-vlm's Gemma 4 vision tower has one head size (head_dim)",
    ),
];

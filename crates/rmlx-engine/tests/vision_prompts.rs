//! Image placement against mlx-vlm 0.7.6 goldens (tests/fixtures/*/golden.json, made by
//! scripts/fixtures/make_vision.py): the real Qwen3-VL and Gemma 4 chat templates render each
//! image's placeholder where its content part is, and expansion gives the golden input ids —
//! single image, two images in one turn, an image in each of two turns, system prompt first.

use std::path::PathBuf;

use rmlx_engine::chat::{
    images::{expand_image_placeholders, splice_image_block, ImageTokens},
    ChatTokenizer, TemplateOptions,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn golden(dir: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap())
        .unwrap()
}

fn tokens(tokenizer: &ChatTokenizer, open: &str, pad: &str, close: &str) -> ImageTokens {
    ImageTokens {
        open: tokenizer.token_id(open),
        pad: tokenizer.token_id(pad).unwrap(),
        close: tokenizer.token_id(close),
    }
}

fn check_family(dir: &str, image_tokens: impl Fn(&ChatTokenizer) -> ImageTokens, count_key: &str) {
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let image_tokens = image_tokens(&tokenizer);
    let golden = golden(dir);
    let images = &golden["preprocessed_images"];
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let messages: Vec<serde_json::Value> = case["messages"].as_array().unwrap().clone();
        let options = TemplateOptions {
            add_generation_prompt: true,
            ..TemplateOptions::default()
        };
        let (prompt, ids) = tokenizer.encode_chat(&messages, &options).unwrap();
        assert_eq!(
            prompt,
            case["prompt"].as_str().unwrap(),
            "{dir}/{}",
            case["name"]
        );
        let counts: Vec<usize> = case["images"]
            .as_array()
            .map(|names| {
                names
                    .iter()
                    .map(|name| {
                        images[name.as_str().unwrap()][count_key].as_u64().unwrap() as usize
                    })
                    .collect()
            })
            .unwrap_or_default();
        let expanded = expand_image_placeholders(&ids, &image_tokens, &counts).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        assert_eq!(expanded.ids, want, "{dir}/{}", case["name"]);
        for (span, count) in expanded.image_spans.iter().zip(&counts) {
            assert_eq!(span.len(), *count);
            assert!(want[span.clone()].iter().all(|&id| id == image_tokens.pad));
        }
        checked += 1;
    }
    assert!(checked >= 5, "{dir}: only {checked} cases");
}

#[test]
fn qwen3_vl_images_expand_in_place_as_mlx_vlm() {
    check_family(
        "qwen3-vl-tiny",
        |t| tokens(t, "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
        "num_image_tokens",
    );
}

#[test]
fn gemma4_images_expand_in_place_with_one_bos() {
    check_family(
        "gemma4-tiny",
        |t| tokens(t, "<|image>", "<|image|>", "<image|>"),
        "num_soft_tokens",
    );
}

#[test]
fn splice_fallback_matches_the_template_placement_for_a_leading_image() {
    // An image-first user turn rendered with its placeholder equals the text-only render with
    // the block spliced in by the fallback (Qwen puts the image right after the turn opener).
    let tokenizer = ChatTokenizer::from_dir(&fixture("qwen3-vl-tiny")).unwrap();
    let image_tokens = tokens(
        &tokenizer,
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
    );
    let options = TemplateOptions {
        add_generation_prompt: true,
        ..TemplateOptions::default()
    };
    let with_image = serde_json::json!([{"role": "user", "content": [
        {"type": "image", "image": "x"}, {"type": "text", "text": "What is in this image?"}]}]);
    let text_only = serde_json::json!([{"role": "user", "content": "What is in this image?"}]);
    let (_, placed) = tokenizer
        .encode_chat(with_image.as_array().unwrap(), &options)
        .unwrap();
    let placed = expand_image_placeholders(&placed, &image_tokens, &[70]).unwrap();
    let (_, plain) = tokenizer
        .encode_chat(text_only.as_array().unwrap(), &options)
        .unwrap();
    let opener = tokenizer.encode("<|im_start|>user\n", false).unwrap();
    let spliced = splice_image_block(&plain, &image_tokens, &[70], &opener, None).unwrap();
    assert_eq!(spliced, placed);
}

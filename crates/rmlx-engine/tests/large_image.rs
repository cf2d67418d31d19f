//! A 2560×2560 image on Qwen3-VL with the real preprocessor ceiling (`size.longest_edge`
//! 16777216, in the qwen3-vl-tiny fixture): exactly 6400 soft tokens, counted from the size
//! alone; a context too small for them is refused before any pixel or vision work; and (opt-in,
//! tens of seconds on a CPU) the whole request completes with the same prompt.

use std::path::PathBuf;

use rmlx_engine::{
    chat::{ChatTokenizer, TemplateOptions},
    engine::{Engine, Prompt, Request},
    generate::GenerateParams,
    multimodal::place_images,
    vision::RgbImage,
    EngineError,
};

const IMAGE_PAD: u32 = 1003;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A smooth 2560×2560 picture (a gradient: what it shows does not matter here).
fn big_image() -> RgbImage {
    RgbImage::from_fn(2560, 2560, |x, y| {
        image::Rgb([(x / 10) as u8, (y / 10) as u8, ((x + y) / 20) as u8])
    })
}

fn request(max_ctx: Option<usize>) -> Request {
    Request {
        model: fixture("qwen3-vl-tiny"),
        prompt: Prompt::Chat {
            messages: vec![serde_json::json!({"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What is in this image?"}]})],
            options: TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        images: vec![big_image()],
        params: GenerateParams {
            max_tokens: 2,
            ignore_eos: true,
            max_ctx,
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

#[test]
fn a_2560_square_image_is_6400_soft_tokens_with_the_real_ceiling() {
    let dir = fixture("qwen3-vl-tiny");
    let tokenizer = ChatTokenizer::from_dir(&dir).unwrap();
    let messages = [serde_json::json!({"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in this image?"}]})];
    let options = TemplateOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let (_, ids) = tokenizer.encode_chat(&messages, &options).unwrap();
    let placed = place_images(
        &dir,
        "qwen3_vl",
        &tokenizer,
        ids,
        &[big_image()],
        None,
        false,
    )
    .unwrap();
    let pads = placed.ids.iter().filter(|&&id| id == IMAGE_PAD).count();
    assert_eq!(pads, 6400);
    assert_eq!(placed.spans[0].len(), 6400);
    assert!(placed.input.is_none(), "counting must not touch pixels");
}

#[test]
fn a_context_too_small_for_the_image_is_refused_before_any_vision_work() {
    let engine = Engine::start(1).unwrap();
    let error = engine
        .submit(request(Some(4096)))
        .unwrap()
        .wait()
        .unwrap_err();
    match error {
        EngineError::ContextOverflow {
            prompt_tokens,
            max_ctx,
        } => {
            assert!(prompt_tokens > 6400, "{prompt_tokens}");
            assert_eq!(max_ctx, 4096);
        }
        other => panic!("expected ContextOverflow, got {other}"),
    }
    // Nothing was left running or reserved.
    let snapshot = engine.metrics();
    assert_eq!(snapshot.in_flight, 0);
}

/// Opt-in (`cargo test --release -p rmlx-engine --test large_image -- --ignored`): the whole
/// 2560² request through the vision tower (25600 patches, query-tiled) and a 6419-token
/// prefill on the CPU backend.
#[test]
#[ignore]
fn a_2560_square_image_completes() {
    let engine = Engine::start(1).unwrap();
    let completion = engine.submit(request(None)).unwrap().wait().unwrap();
    assert!(completion.prompt_tokens > 6400);
    assert_eq!(completion.completion_tokens, 2);
}

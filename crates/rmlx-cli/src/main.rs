//! `rmlx`: the engine on the command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rmlx", version, about = "Run MLX models locally")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check the MLX runtime: library, version, device, and a few real operations.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor { json } => doctor(json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rmlx: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Loads MLX, evaluates a matmul, a softmax and a 4-bit quantized matmul, and reports where.
fn doctor(json: bool) -> anyhow::Result<()> {
    use mlx_rs::{ops, Array};
    let info = rmlx_engine::runtime::runtime_info()?;
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let b = Array::from_slice(&[0.5f32, -1.0, 1.5, 2.0], &[2, 2]);
    let product = ops::matmul(&a, &b)?;
    let softmax = ops::softmax_axis(&product, -1, None)?;
    let w = mlx_rs::random::normal::<f32>(&[64, 64], None, None, None)?;
    let spec = rmlx_engine::quant::QuantSpec::defaults(rmlx_engine::quant::QuantMode::Affine);
    let q = rmlx_engine::quant::quantize(&w, spec)?;
    let x = mlx_rs::random::normal::<f32>(&[1, 64], None, None, None)?;
    let y = rmlx_engine::quant::quantized_matmul(
        &x,
        &q.weight,
        &q.scales,
        q.biases.as_ref(),
        true,
        spec,
    )?;
    mlx_rs::transforms::eval([&product, &softmax, &y])?;
    let product_values = product.as_slice::<f32>().to_vec();
    if json {
        let value = serde_json::json!({
            "runtime": info,
            "matmul": product_values,
            "softmax_row_sums": [softmax.as_slice::<f32>()[0] + softmax.as_slice::<f32>()[1]],
            "quantized_matmul_shape": y.shape(),
        });
        println!("{value}");
    } else {
        println!(
            "MLX {} (pinned {}) from {}",
            info.mlx_version,
            info.compiled_mlx_version,
            info.library.display()
        );
        println!("default device: {}", info.default_device);
        println!(
            "metal: {}  cuda: {}",
            info.metal_available, info.cuda_available
        );
        println!("matmul [[1,2],[3,4]] x [[0.5,-1],[1.5,2]] = {product_values:?}");
        println!(
            "4-bit affine quantized matmul 1x64 @ 64x64: shape {:?}",
            y.shape()
        );
        if info.mlx_version != info.compiled_mlx_version {
            eprintln!(
                "warning: loaded MLX {} differs from the pinned {}",
                info.mlx_version, info.compiled_mlx_version
            );
        }
    }
    Ok(())
}

//! Qwen3-VL vision tower: Conv3d patch embedding (run as one matmul), learned position table
//! bilinearly interpolated to each grid, 2D rotary, pre-norm ViT blocks attending within each
//! image, the 2x2 patch merger and the deepstack mergers. Reference: mlx-vlm
//! `models/qwen3_vl/vision.py` (same order: rotary, patch embed, merger, attention, MLP,
//! block, model).

use mlx_rs::{ops, ops::indexing::IndexOp, Array};

use super::config::VisionConfig;
use crate::{
    attention::{vision_attention, TileConfig},
    error::{EngineError, Result},
    models::{ImageInput, VisionFeatures},
    nn::{gelu, gelu_approx, rotate_half, LayerNorm, Linear},
    weights::{DtypeKind, WeightStore},
};

const NORM_EPS: f32 = 1e-6;
const ROTARY_THETA: f32 = 10000.0;

/// `1 / theta^(arange(0, dim, 2) / dim)`, with mlx's op order so the angles match bit for bit.
pub(super) fn inv_freq(dim: i32, theta: f32) -> Result<Array> {
    let exponents = ops::divide(
        &ops::arange::<_, f32>(0, dim, 2)?,
        Array::from_f32(dim as f32),
    )?;
    let powers = ops::power(Array::from_f32(theta), &exponents)?;
    Ok(ops::divide(Array::from_f32(1.0), &powers)?)
}

/// Conv3d with kernel = stride = (T, P, P) over each patch, in mlx's channels-last layout:
/// the checkpoint's `[out, T, P, P, C]` kernel is used as stored. (A matmul over flattened
/// patches is the same map up to summation order.)
struct PatchEmbed {
    weight: Array,
    bias: Array,
    kernel: (i32, i32, i32),
    in_channels: i32,
}

impl PatchEmbed {
    fn load(store: &mut WeightStore, prefix: &str, args: &VisionConfig) -> Result<Self> {
        let (hidden, t, p, c) = (
            args.hidden_size,
            args.temporal_patch_size,
            args.patch_size,
            args.in_channels,
        );
        // A Hugging Face release stores the PyTorch Conv3d layout [out, in, t, h, w]; MLX's is
        // channels-last (mlx-vlm's sanitize transposes it the same way).
        let name = format!("{prefix}.proj.weight");
        let pytorch = [hidden, c, t, p, p];
        if store.shape_of(&name).as_deref() == Some(&pytorch[..]) && pytorch != [hidden, t, p, p, c]
        {
            store.transform(&name, |w| Ok(w.transpose_axes(&[0, 2, 3, 4, 1])?))?;
        }
        let weight = store.take(&name, &[hidden, t, p, p, c], DtypeKind::Float)?;
        let bias = store.take(&format!("{prefix}.proj.bias"), &[hidden], DtypeKind::Float)?;
        Ok(Self {
            weight,
            bias,
            kernel: (t, p, p),
            in_channels: c,
        })
    }

    fn forward(&self, pixels: &Array) -> Result<Array> {
        let (t, p, _) = self.kernel;
        // mlx-vlm casts pixels to the tower's dtype (bf16 in converted checkpoints).
        let x = pixels
            .as_dtype(self.weight.dtype())?
            .reshape(&[-1, self.in_channels, t, p, p])?
            .transpose_axes(&[0, 2, 3, 4, 1])?;
        let out = ops::conv3d(&x, &self.weight, self.kernel, None, None, None)?;
        let out = ops::add(&out, &self.bias)?;
        Ok(out.reshape(&[-1, self.weight.shape()[0]])?)
    }
}

/// 2x2 spatial merge then a GELU MLP into the language width. The main merger normalises
/// each patch before the merge; deepstack mergers normalise the merged vector.
struct PatchMerger {
    merged: i32,
    postshuffle_norm: bool,
    norm: LayerNorm,
    linear_fc1: Linear,
    linear_fc2: Linear,
}

impl PatchMerger {
    fn load(
        store: &mut WeightStore,
        prefix: &str,
        args: &VisionConfig,
        postshuffle_norm: bool,
    ) -> Result<Self> {
        let merged = args.hidden_size * args.spatial_merge_size * args.spatial_merge_size;
        let norm_dim = if postshuffle_norm {
            merged
        } else {
            args.hidden_size
        };
        Ok(Self {
            merged,
            postshuffle_norm,
            norm: LayerNorm::load(store, &format!("{prefix}.norm"), norm_dim, NORM_EPS)?,
            linear_fc1: Linear::load(
                store,
                None,
                &format!("{prefix}.linear_fc1"),
                merged,
                merged,
                true,
            )?,
            linear_fc2: Linear::load(
                store,
                None,
                &format!("{prefix}.linear_fc2"),
                merged,
                args.out_hidden_size,
                true,
            )?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let x = if self.postshuffle_norm {
            self.norm.forward(&x.reshape(&[-1, self.merged])?)?
        } else {
            self.norm.forward(x)?.reshape(&[-1, self.merged])?
        };
        let x = gelu(&self.linear_fc1.forward(&x)?)?;
        self.linear_fc2.forward(&x)
    }
}

struct Attention {
    heads: i32,
    head_dim: i32,
    scale: f32,
    qkv: Linear,
    proj: Linear,
}

impl Attention {
    fn load(store: &mut WeightStore, prefix: &str, args: &VisionConfig) -> Result<Self> {
        let dim = args.hidden_size;
        let head_dim = dim / args.num_heads;
        Ok(Self {
            heads: args.num_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
            qkv: Linear::load(store, None, &format!("{prefix}.qkv"), dim, dim * 3, true)?,
            proj: Linear::load(store, None, &format!("{prefix}.proj"), dim, dim, true)?,
        })
    }

    /// `segments`: the token range of each frame; tokens attend only within their own frame
    /// (mlx-vlm's `cu_seqlens`).
    fn forward(&self, x: &Array, rotary: &Rotary, segments: &[(i32, i32)]) -> Result<Array> {
        let len = x.shape()[0];
        let qkv = self
            .qkv
            .forward(x)?
            .reshape(&[1, len, 3, self.heads, self.head_dim])?;
        let part = |i: i32| -> Result<Array> {
            Ok(qkv
                .index((.., .., i, .., ..))
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        let queries = rotary.apply(&part(0)?)?;
        let keys = rotary.apply(&part(1)?)?;
        let values = part(2)?;
        let mut outputs = Vec::with_capacity(segments.len());
        for &(start, end) in segments {
            let slice = |a: &Array| a.index((.., .., start..end, ..));
            outputs.push(vision_attention(
                &slice(&queries),
                &slice(&keys),
                &slice(&values),
                self.scale,
                TileConfig::default(),
            )?);
        }
        let output = if outputs.len() == 1 {
            outputs.pop().unwrap()
        } else {
            ops::concatenate(&outputs, 2)?
        };
        let output = output.transpose_axes(&[0, 2, 1, 3])?.reshape(&[len, -1])?;
        self.proj.forward(&output)
    }
}

/// cos/sin of the 2D rotary angles, `[1, 1, tokens, head_dim]`.
struct Rotary {
    cos: Array,
    sin: Array,
}

impl Rotary {
    fn apply(&self, x: &Array) -> Result<Array> {
        let out = ops::add(
            ops::multiply(x, &self.cos)?,
            ops::multiply(rotate_half(x)?, &self.sin)?,
        )?;
        Ok(out.as_dtype(x.dtype())?)
    }
}

struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    attn: Attention,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn load(store: &mut WeightStore, prefix: &str, args: &VisionConfig) -> Result<Self> {
        let (dim, hidden) = (args.hidden_size, args.intermediate_size);
        Ok(Self {
            norm1: LayerNorm::load(store, &format!("{prefix}.norm1"), dim, NORM_EPS)?,
            norm2: LayerNorm::load(store, &format!("{prefix}.norm2"), dim, NORM_EPS)?,
            attn: Attention::load(store, &format!("{prefix}.attn"), args)?,
            fc1: Linear::load(
                store,
                None,
                &format!("{prefix}.mlp.linear_fc1"),
                dim,
                hidden,
                true,
            )?,
            fc2: Linear::load(
                store,
                None,
                &format!("{prefix}.mlp.linear_fc2"),
                hidden,
                dim,
                true,
            )?,
        })
    }

    fn forward(&self, x: &Array, rotary: &Rotary, segments: &[(i32, i32)]) -> Result<Array> {
        let h = ops::add(
            x,
            self.attn
                .forward(&self.norm1.forward(x)?, rotary, segments)?,
        )?;
        let mlp = self
            .fc2
            .forward(&gelu_approx(&self.fc1.forward(&self.norm2.forward(&h)?)?)?)?;
        Ok(ops::add(&h, &mlp)?)
    }
}

pub struct VisionModel {
    args: VisionConfig,
    patch_embed: PatchEmbed,
    pos_embed: Array,
    grid_per_side: i32,
    blocks: Vec<Block>,
    merger: PatchMerger,
    deepstack_mergers: Vec<PatchMerger>,
}

impl VisionModel {
    pub fn load(store: &mut WeightStore, prefix: &str, args: &VisionConfig) -> Result<Self> {
        let grid_per_side = (args.num_position_embeddings as f64).sqrt() as i32;
        Ok(Self {
            patch_embed: PatchEmbed::load(store, &format!("{prefix}.patch_embed"), args)?,
            pos_embed: store.take(
                &format!("{prefix}.pos_embed.weight"),
                &[args.num_position_embeddings, args.hidden_size],
                DtypeKind::Float,
            )?,
            grid_per_side,
            blocks: (0..args.depth)
                .map(|i| Block::load(store, &format!("{prefix}.blocks.{i}"), args))
                .collect::<Result<_>>()?,
            merger: PatchMerger::load(store, &format!("{prefix}.merger"), args, false)?,
            deepstack_mergers: (0..args.deepstack_visual_indexes.len())
                .map(|i| {
                    PatchMerger::load(
                        store,
                        &format!("{prefix}.deepstack_merger_list.{i}"),
                        args,
                        true,
                    )
                })
                .collect::<Result<_>>()?,
            args: args.clone(),
        })
    }

    /// Pixel rows `[patches, C*T*P*P]` of the images in order → merged features
    /// `[patches / merge², out_hidden]` and one deepstack feature array per deepstack index.
    pub fn forward(&self, images: &ImageInput) -> Result<VisionFeatures> {
        let merge = self.args.spatial_merge_size;
        let mut expected = 0;
        for &[t, h, w] in &images.grid_thw {
            if t < 1 || h < 1 || w < 1 || h % merge != 0 || w % merge != 0 {
                return Err(EngineError::InvalidRequest(format!(
                    "image grid {:?} is not a positive multiple of the merge size {merge}",
                    [t, h, w]
                )));
            }
            expected += t * h * w;
        }
        let shape = images.pixel_values.shape();
        if shape != [expected, self.args.patch_dim()] {
            return Err(EngineError::InvalidRequest(format!(
                "pixel_values has shape {shape:?}, the grids need [{expected}, {}]",
                self.args.patch_dim()
            )));
        }
        let x = self.patch_embed.forward(&images.pixel_values)?;
        let mut x = ops::add(&x, &self.position_embeddings(&images.grid_thw)?)?;
        let rotary = self.rotary(&images.grid_thw)?;
        let mut segments = Vec::new();
        let mut start = 0;
        for &[t, h, w] in &images.grid_thw {
            for _ in 0..t {
                segments.push((start, start + h * w));
                start += h * w;
            }
        }
        let mut deepstack = Vec::with_capacity(self.deepstack_mergers.len());
        for (index, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &rotary, &segments)?;
            let layer = index as i32;
            if let Some(slot) = self
                .args
                .deepstack_visual_indexes
                .iter()
                .position(|&i| i == layer)
            {
                deepstack.push(self.deepstack_mergers[slot].forward(&x)?);
            }
        }
        Ok(VisionFeatures {
            embeds: self.merger.forward(&x)?,
            deepstack,
            grid_thw: images.grid_thw.clone(),
        })
    }

    /// The learned `side x side` table sampled bilinearly at each grid's patch centres
    /// (`linspace(0, side-1, h)`), then put in the merge-block patch order.
    fn position_embeddings(&self, grids: &[[i32; 3]]) -> Result<Array> {
        let side = self.grid_per_side;
        let dim = self.args.hidden_size;
        let merge = self.args.spatial_merge_size;
        let mut per_image = Vec::with_capacity(grids.len());
        for &[t, h, w] in grids {
            let axis = |n: i32| -> Result<(Array, Array, Array)> {
                let idx = ops::linspace::<_, f32>(
                    0.0f32,
                    (side - 1) as f32,
                    ops::LinspaceOptions {
                        count: n,
                        endpoint: true,
                    },
                )?;
                let floor = idx.as_type::<i32>()?;
                let ceil = ops::minimum(
                    ops::add(&floor, Array::from_int(1))?,
                    Array::from_int(side - 1),
                )?;
                let frac = ops::subtract(&idx, floor.as_type::<f32>()?)?;
                Ok((floor, ceil, frac))
            };
            let (h_floor, h_ceil, dh) = axis(h)?;
            let (w_floor, w_ceil, dw) = axis(w)?;
            let base_floor = ops::multiply(&h_floor, Array::from_int(side))?;
            let base_ceil = ops::multiply(&h_ceil, Array::from_int(side))?;
            let one = Array::from_f32(1.0);
            let (ndh, ndw) = (ops::subtract(&one, &dh)?, ops::subtract(&one, &dw)?);
            let col = |a: &Array| a.reshape(&[-1, 1]);
            let row = |a: &Array| a.reshape(&[1, -1]);
            let corners = [
                (&base_floor, &w_floor, &ndh, &ndw),
                (&base_floor, &w_ceil, &ndh, &dw),
                (&base_ceil, &w_floor, &dh, &ndw),
                (&base_ceil, &w_ceil, &dh, &dw),
            ];
            let mut sum: Option<Array> = None;
            for (base, w_idx, wh, ww) in corners {
                let index = ops::add(col(base)?, row(w_idx)?)?.reshape(&[-1])?;
                let weight = ops::multiply(col(wh)?, row(ww)?)?.reshape(&[-1, 1])?;
                let rows = self.pos_embed.take_axis(&index, 0)?;
                let term = ops::multiply(&rows, weight.as_dtype(rows.dtype())?)?;
                sum = Some(match sum {
                    None => term,
                    Some(acc) => ops::add(&acc, &term)?,
                });
            }
            let table = ops::tile(sum.unwrap(), &[t, 1])?;
            per_image.push(
                table
                    .reshape(&[t, h / merge, merge, w / merge, merge, dim])?
                    .transpose_axes(&[0, 1, 3, 2, 4, 5])?
                    .reshape(&[-1, dim])?,
            );
        }
        Ok(ops::concatenate(&per_image, 0)?)
    }

    /// 2D rotary: the first half of each head's angles follow the patch row, the second half
    /// the column, in the merge-block order of the patches.
    fn rotary(&self, grids: &[[i32; 3]]) -> Result<Rotary> {
        let merge = self.args.spatial_merge_size;
        let head_dim = self.args.hidden_size / self.args.num_heads;
        let max_hw = grids.iter().flat_map(|g| [g[1], g[2]]).max().unwrap_or(1);
        let table = ops::outer(
            ops::arange::<_, f32>(0, max_hw, 1)?,
            inv_freq(head_dim / 2, ROTARY_THETA)?,
        )?;
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        for &[t, h, w] in grids {
            for _ in 0..t {
                for bh in 0..h / merge {
                    for bw in 0..w / merge {
                        for mh in 0..merge {
                            for mw in 0..merge {
                                rows.push(bh * merge + mh);
                                cols.push(bw * merge + mw);
                            }
                        }
                    }
                }
            }
        }
        let len = rows.len() as i32;
        let rows = table.take_axis(Array::from_slice(&rows, &[len]), 0)?;
        let cols = table.take_axis(Array::from_slice(&cols, &[len]), 0)?;
        let angles = ops::concatenate(&[rows, cols], -1)?;
        let angles = ops::concatenate(&[&angles, &angles], -1)?.reshape(&[1, 1, len, head_dim])?;
        // Kept in f32 as mlx-vlm does; the rotated result is cast back to the input dtype.
        Ok(Rotary {
            cos: ops::cos(&angles)?,
            sin: ops::sin(&angles)?,
        })
    }
}

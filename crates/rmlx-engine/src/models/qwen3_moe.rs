//! Qwen3 MoE (`model_type: qwen3_moe`, Qwen3-30B-A3B): the Qwen3 decoder with a sparse block
//! of softmax-top-k routed SwiGLU experts on every `decoder_sparse_step`-th layer outside
//! `mlp_only_layers`, the dense MLP elsewhere.
//! Reference: mlx-lm `models/qwen3_moe.py` (Qwen3MoeSparseMoeBlock, sanitize).

use std::path::Path;

use mlx_rs::{ops, ops::indexing::IndexOp, Array};
use serde::{Deserialize, Serialize};

use super::{
    qwen3::{self, FeedForward, Mlp},
    switch::{combine, GluActivation, SoftmaxTopK, SwitchGlu, SwitchLinear},
    Part,
};
use crate::{
    config::{ConfigFile, QuantizationConfig},
    error::{EngineError, Result},
    nn::Linear,
    weights::{DtypeKind, WeightStore},
};

/// The MoE keys on top of Qwen3's.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct MoeConfig {
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    #[serde(default = "one")]
    pub decoder_sparse_step: i32,
    #[serde(default)]
    pub mlp_only_layers: Vec<i32>,
    #[serde(default)]
    pub norm_topk_prob: bool,
}

fn one() -> i32 {
    1
}

/// config.json of a `qwen3_moe` checkpoint: Qwen3's keys plus [`MoeConfig`].
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub text: qwen3::Config,
    #[serde(flatten)]
    pub moe: MoeConfig,
}

impl MoeConfig {
    /// Whether layer `index` carries experts (mlx-lm's rule).
    pub(crate) fn is_sparse(&self, index: usize) -> bool {
        !self.mlp_only_layers.contains(&(index as i32))
            && self.num_experts > 0
            && (index as i32 + 1) % self.decoder_sparse_step.max(1) == 0
    }

    fn validate(&self, dir: &Path) -> Result<()> {
        if self.num_experts_per_tok < 1 || self.num_experts_per_tok > self.num_experts {
            return Err(EngineError::Config {
                path: dir.join("config.json"),
                message: format!(
                    "num_experts_per_tok {} must be between 1 and num_experts {}",
                    self.num_experts_per_tok, self.num_experts
                ),
            });
        }
        Ok(())
    }
}

/// Routed experts of one layer.
pub struct SparseMoeBlock {
    router: SoftmaxTopK,
    switch_mlp: SwitchGlu,
}

impl SparseMoeBlock {
    /// Takes `{prefix}.gate` (the router, 8-bit in mlx-community files) and the experts, either
    /// stacked as mlx writes them (`switch_mlp.*`) or one tensor per expert as the Hugging Face
    /// release ships them (`experts.{e}.*`, stacked here like mlx-lm's sanitize).
    pub fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        hidden: i32,
        moe: &MoeConfig,
    ) -> Result<Self> {
        let experts = moe.num_experts;
        let inter = moe.moe_intermediate_size;
        let router = SoftmaxTopK {
            gate: Linear::load(
                store,
                quant,
                &format!("{prefix}.gate"),
                hidden,
                experts,
                false,
            )?,
            experts,
            top_k: moe.num_experts_per_tok,
            normalize: moe.norm_topk_prob,
        };
        if let Some(fused) = Self::load_fused(store, prefix, hidden, moe)? {
            return Ok(Self {
                router,
                switch_mlp: fused,
            });
        }
        let per_expert = store.contains(&format!("{prefix}.experts.0.gate_proj.weight"));
        let mut projection = |name: &str, in_dim: i32, out_dim: i32| -> Result<SwitchLinear> {
            if per_expert {
                let rows = (0..experts)
                    .map(|e| {
                        store.take(
                            &format!("{prefix}.experts.{e}.{name}.weight"),
                            &[out_dim, in_dim],
                            DtypeKind::Float,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(SwitchLinear::dense(store.derived(ops::stack(&rows, 0)?)?))
            } else {
                SwitchLinear::load(
                    store,
                    quant,
                    &format!("{prefix}.switch_mlp.{name}"),
                    experts,
                    in_dim,
                    out_dim,
                )
            }
        };
        let switch_mlp = SwitchGlu {
            gate_proj: projection("gate_proj", hidden, inter)?,
            up_proj: projection("up_proj", hidden, inter)?,
            down_proj: projection("down_proj", inter, hidden)?,
            activation: GluActivation::Silu,
        };
        Ok(Self { router, switch_mlp })
    }

    /// Qwen3-VL-MoE's Hugging Face layout: `experts.gate_up_proj` `[E, hidden, 2·inter]` (gate
    /// then up along the last axis) and `experts.down_proj` `[E, inter, hidden]`, both the
    /// transpose of mlx's (mlx-vlm `qwen3_vl_moe.py` sanitize splits and transposes the same).
    fn load_fused(
        store: &mut WeightStore,
        prefix: &str,
        hidden: i32,
        moe: &MoeConfig,
    ) -> Result<Option<SwitchGlu>> {
        let gate_up_name = format!("{prefix}.experts.gate_up_proj");
        if !store.contains(&gate_up_name) {
            return Ok(None);
        }
        let (experts, inter) = (moe.num_experts, moe.moe_intermediate_size);
        let gate_up = store.take(
            &gate_up_name,
            &[experts, hidden, 2 * inter],
            DtypeKind::Float,
        )?;
        let down = store.take(
            &format!("{prefix}.experts.down_proj"),
            &[experts, inter, hidden],
            DtypeKind::Float,
        )?;
        let mut half = |range: std::ops::Range<i32>| -> Result<SwitchLinear> {
            let half = gate_up.index((.., .., range)).swap_axes(-1, -2)?;
            Ok(SwitchLinear::dense(store.derived(half)?))
        };
        let gate_proj = half(0..inter)?;
        let up_proj = half(inter..2 * inter)?;
        Ok(Some(SwitchGlu {
            gate_proj,
            up_proj,
            down_proj: SwitchLinear::dense(store.derived(down.swap_axes(-1, -2)?)?),
            activation: GluActivation::Silu,
        }))
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (indices, scores) = self.router.route(x)?;
        combine(&self.switch_mlp.forward(x, &indices)?, &scores)
    }
}

/// Builds the Qwen3 decoder with experts where the config places them.
pub fn load(
    dir: &Path,
    config: &ConfigFile,
    store: &mut WeightStore,
    part: Part,
) -> Result<qwen3::Model> {
    let args: Config = config.family(dir)?;
    args.moe.validate(dir)?;
    let quant = config.base.quantization.as_ref();
    let (hidden, intermediate) = (args.text.hidden_size, args.text.intermediate_size);
    let moe = args.moe.clone();
    qwen3::Model::load_with(
        dir,
        config,
        store,
        args.text,
        part,
        |store, prefix, index| {
            Ok(if moe.is_sparse(index) {
                FeedForward::Experts(SparseMoeBlock::load(store, quant, prefix, hidden, &moe)?)
            } else {
                FeedForward::Dense(Mlp::load(store, quant, prefix, hidden, intermediate)?)
            })
        },
    )
}

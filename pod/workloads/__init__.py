"""Workloads: layers, models, losses, optimizers and datasets in numpy.

Heavy ops go through a `chip.TensorCore` so that they are costed (simulated
time) and follow TPU numerics (bf16 inputs, float32 accumulation). No Ray.
"""

from pod.workloads.attention import CausalSelfAttention
from pod.workloads.datasets import DATASET_NAMES, Dataset, load_dataset
from pod.workloads.layers import (
                                  AveragePooling2D,
                                  Conv2D,
                                  Dense,
                                  Dropout,
                                  Flatten,
                                  Layer,
                                  MaxPool2D,
                                  ReLU,
                                  Sigmoid,
                                  Softmax,
                                  Tanh,
)
from pod.workloads.losses import sigmoid_binary_cross_entropy, softmax_cross_entropy
from pod.workloads.models import MODEL_NAMES, Model, build_model
from pod.workloads.moe import ExpertHooks, MoE, RouterLoad
from pod.workloads.normalization import BatchNormalization
from pod.workloads.optimizers import (
                                  OPTIMIZER_NAMES,
                                  SGD,
                                  Adam,
                                  AdamW,
                                  Optimizer,
                                  build_optimizer,
)
from pod.workloads.recurrent import LSTM, Embedding
from pod.workloads.resnet import GlobalAveragePooling2D, MaxPool2DSame, ResidualBlock, build_resnet
from pod.workloads.transformer import (
                                  MLP,
                                  LayerNorm,
                                  RMSNorm,
                                  TensorHooks,
                                  TokenEmbedding,
                                  TransformerBlock,
                                  TransformerConfig,
                                  TransformerModel,
                                  Unembed,
)

__all__ = [
    "Model",
    "build_model",
    "MODEL_NAMES",
    "Optimizer",
    "build_optimizer",
    "OPTIMIZER_NAMES",
    "Dataset",
    "load_dataset",
    "DATASET_NAMES",
    "softmax_cross_entropy",
    "sigmoid_binary_cross_entropy",
    "Layer",
    "Dense",
    "Conv2D",
    "ReLU",
    "MaxPool2D",
    "Dropout",
    "Flatten",
    "AveragePooling2D",
    "Tanh",
    "Sigmoid",
    "Softmax",
    "BatchNormalization",
    "Embedding",
    "LSTM",
    "SGD",
    "Adam",
    "AdamW",
    "CausalSelfAttention",
    "RMSNorm",
    "LayerNorm",
    "MLP",
    "MoE",
    "ExpertHooks",
    "RouterLoad",
    "TransformerBlock",
    "TensorHooks",
    "TokenEmbedding",
    "Unembed",
    "TransformerConfig",
    "TransformerModel",
    "ResidualBlock",
    "MaxPool2DSame",
    "GlobalAveragePooling2D",
    "build_resnet",
]

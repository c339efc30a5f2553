"""DeepSpeedExamples' training/gan/utils.py: the GAN example's command line and seeding."""

import argparse
import os
import random

import numpy as np
import torch


def get_argument_parser():
    parser = argparse.ArgumentParser(description="DCGAN with DeepSpeed")
    parser.add_argument("--dataset", default="fake", help="fake (synthetic images; the shrink has no others)")
    parser.add_argument("--dataroot", default=None, help="path to the data set (unused by fake)")
    parser.add_argument("--workers", type=int, default=0, help="data loading workers")
    parser.add_argument("--batchSize", type=int, default=8, help="input batch size")
    parser.add_argument("--imageSize", type=int, default=16, help="height and width of the images")
    parser.add_argument("--nz", type=int, default=8, help="size of the latent vector z")
    parser.add_argument("--ngf", type=int, default=8)
    parser.add_argument("--ndf", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1, help="passes over the data")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for Adam")
    parser.add_argument("--cuda", action="store_true", help="enables cuda")
    parser.add_argument("--ngpu", type=int, default=1, help="number of GPUs to use")
    parser.add_argument("--netG", default="", help="path to netG (to continue training)")
    parser.add_argument("--netD", default="", help="path to netD (to continue training)")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument(
        "--outf", default="./gan_output", help="folder for output images and model checkpoints"
    )
    parser.add_argument("--local_rank", type=int, default=0, help="local rank passed by a launcher")
    # the shrink: how many synthetic images, and the per-step losses as JSON
    parser.add_argument("--num-images", type=int, default=48)
    parser.add_argument("--losses-out", default=None)
    return parser


def set_seed(value):
    print("Random Seed: ", value)
    random.seed(value)
    torch.manual_seed(value)
    torch.cuda.manual_seed_all(value)
    np.random.seed(value)


def create_folder(folder):
    os.makedirs(folder, exist_ok=True)

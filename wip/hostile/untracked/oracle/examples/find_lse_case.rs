//! Temporary search (not committed): an input of the linear_cross_entropy
//! fuzz target whose logsumexp is far below its terms.
use packshard_equivalence::fuzz::vocab::LinearFuzzCase;
use packshard_oracle::{fuzzing, registry};
use rand::{Rng, SeedableRng};

fn main() {
    let list = registry::linear_cross_entropy();
    let reference = registry::find(&list, "reference").unwrap().make_small().unwrap();
    let fused = registry::find(&list, "linear_ce_fused").unwrap().make_small().unwrap();
    let target = fuzzing::target("linear_cross_entropy").unwrap();
    let seed: u64 = std::env::args().nth(1).map_or(0, |s| s.parse().unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for i in 0..2_000_000u64 {
        let len = rng.random_range(0..=256usize);
        let buf: Vec<u8> = (0..len).map(|_| rng.random::<u8>()).collect();
        let Ok(case) = LinearFuzzCase::from_bytes(&buf) else { continue };
        let c = &case.case;
        let v = c.map.vocab_size();
        let hidden = c.hidden.mapv(|x| f64::from(x as f32));
        let weight = c.weight.slice(ndarray::s![..v, ..]).mapv(|x| f64::from(x as f32));
        let Ok(r) = reference.linear_cross_entropy(hidden.view(), weight.view(), &c.targets, &c.config, false) else { continue };
        let Ok(f) = fused.linear_cross_entropy(hidden.view(), weight.view(), &c.targets, &c.config, false) else { continue };
        let lr = r.ce.logsumexp();
        let lf = f.ce.logsumexp();
        let scale = lr.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
        let err = lr.iter().zip(lf.iter()).filter(|(a, _)| a.is_finite()).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        if scale < 1e-20 && err > 256.0 * f64::from(f32::EPSILON) * scale && !lr.is_empty() {
            let ok = (target.run)(&buf).is_ok();
            println!("input {i} seed {seed}: scale {scale:e} err {err:e} new-rule ok {ok}: {}", case.describe());
            if ok {
                std::fs::write(format!("/tmp/lse_case_{seed}_{i}"), &buf).unwrap();
                return;
            }
        }
    }
}

//! The schedules against their published order, and every valid shape run on paper.

use super::*;

fn compute_only(s: &PipelineSchedule, rank: usize) -> String {
    s.ranks[rank].iter().filter(|a| a.is_compute()).map(ToString::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn one_f_one_b_warms_up_pp_minus_rank_minus_one_forwards() {
    // Narayanan et al. 2021, Fig. 4 (top): 4 ranks, 8 micro-batches.
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    assert_eq!(compute_only(&s, 0), "0F0,0F1,0F2,0F3,0B0,0F4,0B1,0F5,0B2,0F6,0B3,0F7,0B4,0B5,0B6,0B7");
    assert_eq!(compute_only(&s, 3), "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7");
    for r in 0..4 {
        let warmup = s.ranks[r].iter().filter(|a| a.is_compute()).take_while(|a| a.kind() == "F").count();
        assert_eq!(warmup, 4 - r, "rank {r}: pp − r − 1 warm-up forwards, then the first steady forward");
    }
    let g = PipelineSchedule::new(ScheduleKind::GPipe, 2, 3, 1).unwrap();
    assert_eq!(compute_only(&g, 1), "1F0,1F1,1F2,1B0,1B1,1B2");
}

#[test]
fn the_text_form_is_torchs_and_reads_back() {
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    assert_eq!(
        s.to_csv(),
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
         1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1"
    );
    assert_eq!(PipelineSchedule::from_csv(&s.to_csv()).unwrap(), s);
    let i = PipelineSchedule::new(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
    assert_eq!(PipelineSchedule::from_csv(&i.to_csv()).unwrap(), i);
    let e = "0F0,0X1".parse::<Action>().unwrap_err().to_string();
    assert!(e.contains("\"0X1\"") || e.contains("0X1"), "{e}");
    assert!(PipelineSchedule::from_csv("0F0,oops").unwrap_err().to_string().contains("\"oops\""));
}

#[test]
fn interleaved_follows_megatrons_chunk_and_microbatch_order() {
    // pp 2, v 2, m 4: rank 0 holds stages 0 and 2; forwards take micro-batches in groups of pp per chunk.
    let s = PipelineSchedule::new(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
    let forwards: Vec<String> = s.ranks[0].iter().filter(|a| a.kind() == "F").map(ToString::to_string).collect();
    assert_eq!(forwards, ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]);
    // Warm-up: (pp − r − 1)·2 + (v − 1)·pp forwards before the first backward.
    for (r, warmup) in [(0, 4), (1, 2)] {
        let before = s.ranks[r].iter().filter(|a| a.is_compute()).take_while(|a| a.kind() == "F").count();
        assert_eq!(before, warmup + 1, "rank {r}");
    }
}

#[test]
fn every_valid_shape_runs_without_deadlock_with_the_published_bubble() {
    let mut checked = 0;
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B] {
        for pp in [1, 2, 4] {
            for m in [1, 2, 4, 8] {
                for v in [1, 2, 3] {
                    let Ok(s) = PipelineSchedule::new(kind, pp, m, v) else { continue };
                    let report =
                        simulate(&s, Costs::default()).unwrap_or_else(|e| panic!("{kind} pp {pp} m {m} v {v}: {e}"));
                    let (p, m, v) = (pp as f64, m as f64, s.virtual_stages as f64);
                    let expected = (p - 1.0) / (v * m + p - 1.0);
                    for (r, b) in report.bubble.iter().enumerate() {
                        assert!(
                            (b - expected).abs() < 1e-9,
                            "{kind} pp {pp} m {m} v {v} rank {r}: bubble {b}, expected {expected}"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 20, "{checked} shapes");
}

#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe() {
    let (pp, m) = (4, 8);
    let gpipe = simulate(&PipelineSchedule::new(ScheduleKind::GPipe, pp, m, 1).unwrap(), Costs::default()).unwrap();
    let ofob = simulate(&PipelineSchedule::new(ScheduleKind::OneFOneB, pp, m, 1).unwrap(), Costs::default()).unwrap();
    assert_eq!(gpipe.peak_in_flight, [8, 8, 8, 8]);
    assert_eq!(ofob.peak_in_flight, [4, 3, 2, 1], "pp − rank micro-batches in flight");
    assert_eq!(gpipe.makespan, ofob.makespan, "the same bubble");
}

#[test]
fn shapes_that_cannot_run_are_refused_with_what_fits() {
    let e = PipelineSchedule::new(ScheduleKind::OneFOneB, 4, 2, 1).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid configuration pipeline_parallel_microbatches = \"2\": 2 micro-batch(es) cannot fill 4 pipeline \
         ranks (each would idle most of the step); use at least 4, e.g. 16 for a bubble of 16 %"
    );
    let e = PipelineSchedule::new(ScheduleKind::Interleaved1F1B, 4, 6, 2).unwrap_err().to_string();
    assert!(
        e.ends_with("interleaved 1F1B takes micro-batches in groups of pp = 4; use a multiple of 4 (4 or 8)"),
        "{e}"
    );
    let e = PipelineSchedule::new(ScheduleKind::Interleaved1F1B, 2, 4, 1).unwrap_err().to_string();
    assert!(e.contains("at least 2 stages per rank"), "{e}");
    let e = PipelineSchedule::new(ScheduleKind::GPipe, 2, 4, 2).unwrap_err().to_string();
    assert!(e.contains("GPipe runs 1 stage per rank"), "{e}");
    assert_eq!("1f1b".parse::<ScheduleKind>().unwrap(), ScheduleKind::OneFOneB);
    assert_eq!("interleaved_1f1b".parse::<ScheduleKind>().unwrap(), ScheduleKind::Interleaved1F1B);
    assert!("zb".parse::<ScheduleKind>().unwrap_err().to_string().contains("GPipe, 1F1B, Interleaved1F1B"));
}

#[test]
fn the_simulator_catches_broken_schedules() {
    // Both ranks wait first: a deadlock naming each blocked action.
    let s = PipelineSchedule::from_csv("0RECV_B0,0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0").unwrap();
    let e = simulate(&s, Costs::default()).unwrap_err().to_string();
    assert_eq!(e, "invalid argument: pipeline schedule: deadlock: rank 0 waits at 0RECV_B0; rank 1 waits at 1RECV_F0");
    // Receives out of their sending order: the wrong tensor would arrive.
    let s = PipelineSchedule::from_csv(
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F1,1F1,1RECV_F0,1F0,1B0,1SEND_B0,1B1,1SEND_B1",
    )
    .unwrap();
    let e = simulate(&s, Costs::default()).unwrap_err().to_string();
    assert!(
        e.contains("rank 1 expects 0SEND_F1 from rank 0 at 1RECV_F1, but the next message from rank 0 is 0SEND_F0"),
        "{e}"
    );
    // A backward before its forward; a micro-batch never run.
    let s = PipelineSchedule::from_csv("0B0,0F0\n1F0").unwrap();
    assert!(simulate(&s, Costs::default()).unwrap_err().to_string().contains("rank 0 runs 0B0 before its forward"));
}

#[test]
fn the_timeline_draws_each_ranks_work_and_bubble() {
    let costs = Costs::default(); // forward 1, backward 2
    let ofob = simulate(&PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap(), costs).unwrap();
    assert_eq!(ofob.draw(1.0), "rank 0 |01..aa.bb|\nrank 1 |.0aa1bb..|");
    let gpipe = simulate(&PipelineSchedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap(), costs).unwrap();
    assert_eq!(gpipe.draw(1.0), "rank 0 |01...aabb|\nrank 1 |.01aabb..|");
}
